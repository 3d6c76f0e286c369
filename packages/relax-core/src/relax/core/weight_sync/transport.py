"""The shape every transport shares: the driver orchestrates, the trainer's process sends, each
engine's process receives.

``Transport.sync(trainer, engines, version)`` (driver) asks the trainer actor to ``push``: inside the
trainer's process the transport calls ``begin`` on every engine's receiver, streams
``trainer.export_weights(bucket_bytes)`` to them bucket by bucket (:meth:`Transport.send`, one bucket
in flight), calls ``end`` and checks that every engine serves ``version``. The driver only sees a
small progress record per bucket, never weights. With a local trainer (colocated, tests) ``push``
runs in the caller's process.

Each side rebuilds the transport in its own process from a :class:`TransportSpec` through the plugin
registry (:func:`serve_sender` / :func:`serve_receiver`, hosted by one method on the trainer and
engine actors), so a third-party transport plugs in by registering a :class:`Transport` subclass:
these base classes are the contract for moving weights between processes (the controller itself
calls only ``relax.core.protocols.WeightSync``: ``sync``, ``check_engine``, ``close``). At the end of a
run each role closes the sides kept in its process (:func:`release_sides`), the driver its instance.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from relax.core.context import PluginContext
from relax.core.weight_sync.base import (
    WeightSyncError,
    actor_label,
    check_versions,
    describe_error,
    engine_names,
    is_actor,
    run_local,
    stats,
    wait_all,
)

PROGRESS_GRACE_S = 10.0  # beyond a transport's own deadlines, how long the driver waits for the trainer


@dataclass(frozen=True)
class TransportSpec:
    """All a process needs to rebuild a transport: registered name, typed params, context, and the
    id of the driver's instance (sides built for one instance are reused until another arrives)."""

    name: str
    uid: str
    params: Any
    ctx: PluginContext


class Receiver:
    """Engine side, built once per transport instance in the engine's process around the engine
    object. Optional ``begin_weight_update`` / ``end_weight_update`` are called if the engine has them."""

    def __init__(self, transport: Transport, engine: Any):
        if not callable(getattr(engine, "update_weights", None)):
            raise WeightSyncError(
                f"weight_sync transport {transport.name!r} cannot serve engine {type(engine).__name__}: "
                "it has no update_weights(named_tensors, version)"
            )
        self.transport, self.engine = transport, engine

    def begin(self, version: int) -> None:
        hook = getattr(self.engine, "begin_weight_update", None)
        if callable(hook):
            hook(version)

    def update(self, bucket: Any, version: int) -> None:
        self.engine.update_weights(bucket, version)

    def end(self, version: int) -> int:
        hook = getattr(self.engine, "end_weight_update", None)
        if callable(hook):
            hook(version)
        return self.engine.weight_version()

    def close(self) -> None:
        """Release what the receiver holds (groups, buffers); called when a newer transport replaces it."""


class Peers:
    """The engines as the sender sees them: each call reaches the engine's receiver for this
    transport (through the actor's ``weight_receiver`` endpoint, or directly for a local object)."""

    def __init__(self, transport: Transport, engines: list[Any]):
        self.transport, self.engines, self.names = transport, list(engines), engine_names(engines)

    def start(self, method: str, *args: Any) -> dict[str, cf.Future]:
        return self.start_each(method, [args] * len(self.engines))

    def start_each(self, method: str, args: list[tuple]) -> dict[str, cf.Future]:
        """``method`` on every receiver with per-engine arguments, without waiting."""
        spec = self.transport.spec
        pending = {}
        for name, engine, a in zip(self.names, self.engines, args, strict=True):
            if is_actor(engine):
                pending[name] = engine.weight_receiver.remote(spec, method, *a).future()
            else:
                pending[name] = run_local(getattr(self.transport.local_receiver(engine), method), *a)
        return pending

    def wait(self, pending: dict[str, cf.Future], what: str) -> dict[str, Any]:
        return wait_all(pending, self.transport.timeout_s, what)

    def call(self, method: str, *args: Any, what: str | None = None) -> dict[str, Any]:
        return self.wait(self.start(method, *args), what or method)


class Transport:
    """Base for weight-sync transports. A subclass sets ``name`` (its registered name), ``config``
    (its params dataclass) and ``receiver_cls``, and implements :meth:`send`; ``engines`` lists the
    registered rollout engines it can serve (None: any engine with ``update_weights``).

    Constructed as ``factory(params, ctx)``; keywords override params fields and ``ctx.timeout_s`` /
    ``ctx.bucket_bytes`` (``BroadcastSync(timeout_s=5, backend="gloo")``).
    """

    name: ClassVar[str] = ""
    config: ClassVar[type | None] = None
    receiver_cls: ClassVar[type[Receiver]] = Receiver
    engines: ClassVar[tuple[str, ...] | None] = None
    actors_only: ClassVar[bool] = False  # engines must be separate processes (Ray actors)
    #: where the two sides may run: "cluster" (any nodes), "host" (one machine; refused across nodes),
    #: "shared_path" (a directory every node sees; the transport checks it). See ``weight_sync.nodes``.
    reach: ClassVar[str] = "cluster"

    def __init__(self, params: Any = None, ctx: PluginContext | None = None, **overrides: Any):
        ctx_fields = {k: overrides.pop(k) for k in ("timeout_s", "bucket_bytes") if k in overrides}
        self.ctx = dataclasses.replace(ctx or PluginContext(role="weight_sync"), **ctx_fields)
        if self.config is None:
            self.params = {**(params or {}), **overrides}
        elif isinstance(params, self.config):
            self.params = dataclasses.replace(params, **overrides)
        else:
            self.params = self.config(**{**(params or {}), **overrides})
        self.uid = uuid.uuid4().hex
        self._local: dict[int, tuple[Any, Receiver]] = {}

    @property
    def timeout_s(self) -> float:
        return self.ctx.timeout_s

    @property
    def bucket_bytes(self) -> int:
        return self.ctx.bucket_bytes

    @property
    def spec(self) -> TransportSpec:
        return TransportSpec(self.name, self.uid, self.params, self.ctx)

    def check_engine(self, engine: str) -> None:
        """Start-up check: can this transport serve the registered rollout engine ``engine``?"""
        if self.engines is not None and engine not in self.engines:
            raise WeightSyncError(
                f"weight_sync.transport {self.name!r} cannot serve rollout.engine {engine!r}; "
                f"it serves: {', '.join(self.engines)}"
            )

    # ------------------------------------------------------------------ driver
    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        """Move the trainer's weights to every engine as ``version``; returns stats (driver side)."""
        started = time.perf_counter()
        local = [n for n, e in zip(engine_names(engines), engines, strict=True) if not is_actor(e)]
        if local and (self.actors_only or is_actor(trainer)):
            why = f"the {self.name} transport" if self.actors_only else "a trainer actor"
            raise WeightSyncError(
                f"{why} needs engines that are Ray actors; local objects: {', '.join(local)}"
            )
        if self.reach == "host":
            from relax.core.weight_sync.nodes import check_same_host

            check_same_host(self.name, trainer, engines)
        if is_actor(trainer):
            last = self._remote_push(trainer, engines, version)
        else:
            *_, last = self.push(trainer, engines, version)
        return stats(time.perf_counter() - started, int(last["bytes"]), int(last["buckets"]), len(engines))

    def _remote_push(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        import ray

        label = f"trainer ({actor_label(trainer)})"
        wait_s = (
            3 * self.timeout_s + PROGRESS_GRACE_S
        )  # between reports: a few steps, each timed by the transport
        stream = trainer.weight_sender.options(num_returns="streaming").remote(
            self.spec, "push", engines, version
        )
        last: dict[str, float] | None = None
        while True:
            try:
                ref = stream._next_sync(wait_s)  # public iteration has no timeout
            except StopIteration:
                break
            if ref.is_nil():
                raise WeightSyncError(
                    f"{label} reported no weight-sync progress within {wait_s:g}s (version {version})"
                )
            try:
                last = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise WeightSyncError(f"{label} died while pushing weights (version {version})") from exc
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, WeightSyncError):
                    raise WeightSyncError(str(exc.cause)) from exc
                raise WeightSyncError(f"{label} failed while pushing weights: {describe_error(exc)}") from exc
        if last is None:
            raise WeightSyncError(f"{label} pushed nothing for version {version}")
        return last

    # ------------------------------------------------------------------ sender (trainer's process)
    def push(self, trainer: Any, engines: list[Any], version: int) -> Iterator[dict[str, float]]:
        """begin, every bucket, end, version check; yields running totals after begin and each bucket."""
        peers = Peers(self, engines)
        peers.call("begin", version, what=f"begin_weight_update({version})")
        nbytes = buckets = 0
        yield {"bytes": nbytes, "buckets": buckets}
        for sent in self.send(trainer, peers, version):
            nbytes, buckets = nbytes + sent, buckets + 1
            yield {"bytes": nbytes, "buckets": buckets}
        check_versions(peers.call("end", version, what=f"end_weight_update({version})"), version)
        yield {"bytes": nbytes, "buckets": buckets}

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        """Stream ``trainer.export_weights(self.bucket_bytes)`` to ``peers``; yield bytes per bucket."""
        raise NotImplementedError

    # ------------------------------------------------------------------ receivers
    def receiver(self, engine: Any) -> Receiver:
        return self.receiver_cls(self, engine)

    def local_receiver(self, engine: Any) -> Receiver:
        held = self._local.get(id(engine))
        if held is None or held[0] is not engine:
            held = self._local[id(engine)] = (engine, self.receiver(engine))
        return held[1]

    def close(self) -> None:
        """Release what this instance holds: the driver's at the end of the run, a sender side's when a
        newer transport replaces it or the run ends (its receivers in this process too)."""
        for _, receiver in self._local.values():
            receiver.close()
        self._local.clear()


def build(spec: TransportSpec) -> Transport:
    """The transport named in ``spec``, built from the plugin registry in this process."""
    from relax.core.plugins import get_plugin_manager

    transport = get_plugin_manager().get("weight_sync", spec.name)(spec.params, spec.ctx)
    transport.uid = spec.uid
    return transport


_LOCK = threading.Lock()


def _side(host: Any, spec: TransportSpec, make: Any) -> Any:
    """The side object for ``spec`` kept on ``host`` (one per transport name; a new instance replaces it)."""
    with _LOCK:
        sides = host.__dict__.setdefault("_relax_weight_sync", {})
        held = sides.get(spec.name)
        if held is None or held[0] != spec.uid:
            if held is not None:
                held[1].close()
            held = sides[spec.name] = (spec.uid, make(build(spec)))
        return held[1]


def release_sides(host: Any) -> None:
    """End of run, in a role's process: close and forget every side kept on ``host`` (a sender's
    temporary files or group, a receiver's buffers), whichever transport built them."""
    with _LOCK:
        held = host.__dict__.pop("_relax_weight_sync", {})
    errors = []
    for _, side in held.values():
        try:
            side.close()
        except Exception as exc:  # close the others, then report
            errors.append(exc)
    if errors:
        raise errors[0]


def serve_sender(host: Any, trainer: Any, spec: TransportSpec, method: str, *args: Any) -> Iterator[Any]:
    """Trainer-actor endpoint: ``transport.<method>(trainer, *args)``, always as a generator
    (``push`` streams progress; the actor method is a Ray streaming generator)."""
    transport = _side(host, spec, lambda t: t)
    result = getattr(transport, method)(trainer, *args)
    if isinstance(result, Iterator):
        yield from result
    else:
        yield result


def serve_receiver(host: Any, engine: Any, spec: TransportSpec, method: str, *args: Any) -> Any:
    """Engine-actor endpoint: ``receiver.<method>(*args)`` on the transport's receiver for ``engine``."""
    return getattr(_side(host, spec, lambda t: t.receiver(engine)), method)(*args)
