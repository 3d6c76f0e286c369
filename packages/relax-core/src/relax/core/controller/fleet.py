"""The run's rollout engines as a mutable fleet: routing, eviction, replacement, control calls.

An engine that dies, or does not answer a control call within ``rollout.control_timeout_s`` (or a
generate call within ``rollout.timeout_s``), is evicted: removed from routing (its in-flight
requests go to the other engines, see :mod:`relax.core.controller.router`) and killed. A
replacement with a new, never reused index is started up to ``rollout.max_restarts`` times in
total, after ``rollout.restart_backoff_s`` (doubled after each replacement that failed to start),
synced to the current weight version, and only then routed to; on a cluster only once Ray has ruled on
the lost engine's node and its reservation sits on an alive node (``controller.places``), however long
that takes. ``shortfall`` says what a missing engine waits for, or why it will not be replaced. With no
engine left and no replacement coming, waiting streams fail with :class:`NoEnginesLeft` naming the last loss.

Weight sync flows one way: the controller asks the fleet to ``sync(version)`` (colocate, resume) or
``publish(version, abort)`` (async modes); the fleet hands the transport (built for the run and given
at construction, with the trainer) the serving engines and returns ``weight_sync/*`` metrics. Nothing
calls back up. ``version`` is the version of the trainer's weights as the controller last told the
fleet (``sync``, ``publish``, or ``trained`` when a step commits): a replacement engine is synced to
it. ``weights_lock`` serialises everything that must see the trainer's weights equal to that
version: the mode loops hold it from a train step until its version is committed (and through
weight publication), and a replacement is synced under it, so a new engine gets exactly the
version it is labelled with. ``add_engine(s)`` / ``remove_engine`` are the control API behind
``RunState.add_engine`` / ``remove_engine`` (called between steps by ``RunControl``) and behind the
control plane's scale operations (called from its own thread, like a replacement). A scale-in
drains: the engine gets no new requests while its in-flight ones finish, up to a timeout, and only
then is removed (what is still in flight goes to the other engines).

Attaching by URL (``attach_engines``): an engine backend that can serve from a running server declares
at registration which of its ``rollout.engine_params`` fields lists the URLs (``register(..., attach=
"urls")``); each attached engine is started with that field overridden to its one URL (``engine_params``
of ``start_engine``), and its replacement re-attaches to the same URL. Core knows no backend here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from relax.core.controller import local
from relax.core.controller.faults import FaultCounters, NoEnginesLeft, RoleError, describe
from relax.core.controller.replacements import Replacements
from relax.core.controller.router import EngineRouter
from relax.core.controller.shortfall import Lost, Shortfall
from relax.core.plugins import attach_param

if TYPE_CHECKING:
    from relax.core.controller.places import EnginePlaces
    from relax.core.protocols import WeightSync

log = logging.getLogger("relax")

READY_POLL_S = 0.5
DRAIN_POLL_S = 0.1

#: ``on_phase(phase, indices)``: engines being added reached ``phase`` -- "creating", "health-checking",
#: "weight-syncing", then "active" once they serve
PhaseFn = Callable[[str, list[int]], None]


def with_engine_params(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``cfg`` with fields of ``rollout.engine_params`` (a dataclass, or a dict for an untyped engine)
    replaced: the config one engine of the fleet starts from (e.g. attached to its own URL)."""
    params = cfg.rollout.engine_params
    params = {**params, **overrides} if isinstance(params, dict) else replace(params, **overrides)
    return replace(cfg, rollout=replace(cfg.rollout, engine_params=params))


def kill(handle: Any) -> None:
    """Kill an actor, ignoring one that is already gone (Ray also reaps a stopped process)."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already dead, or Ray is shutting down
        log.debug("kill: %s", exc)


class EngineFleet:
    def __init__(
        self,
        cfg: Any,
        engines: list[Any],
        start_engine: Callable[[int, int | None], Any],
        transport: WeightSync,
        trainer: Any,
        counters: FaultCounters | None = None,
        on_change: Callable[[list[Any]], None] | None = None,
        version: int = 0,
        places: EnginePlaces | None = None,
    ) -> None:
        """``engines``: the run's engine list (``Roles.engines``), kept equal to the live set;
        ``start_engine(index, slot[, engine_params=overrides])`` creates an engine actor on the reservation
        of configured engine ``slot`` (None: outside the reservation), with ``rollout.engine_params``
        fields overridden for that engine alone when given; ``transport.sync(trainer, handles, version)``
        moves ``trainer``'s weights to engines (the run's ``weight_sync`` transport); ``on_change(engines)``
        is told the serving engines whenever the set changes (e.g. the reward's judge handle);
        ``version``: the version the trainer's weights carry now; ``places``: what Ray says about where an
        engine can live (``controller.places``; None: a replacement starts after its back-off alone)."""
        self.rollout = cfg.rollout
        self.engines = engines
        self.router = EngineRouter(dict(enumerate(engines)), on_failure=self.evict)
        self.weights_lock = threading.RLock()
        self.counters = counters or FaultCounters()
        self._start_engine = start_engine
        self.transport, self.trainer, self.version = transport, trainer, version
        self._on_change = on_change or (lambda engines: None)
        self._lock = threading.Lock()
        self._next_index = len(engines)
        self._slots: dict[int, int | None] = {i: i for i in range(len(engines))}  # index -> reservation slot
        self._free_slots: list[int] = []  # reservations of removed engines, for engines added later
        self._params: dict[int, dict[str, Any]] = {}  # index -> its own engine_params overrides (attached)
        self._stop = threading.Event()
        self._places = places
        self.shortfall = Shortfall(len(engines))  # engines wanted, missing, waiting, not coming back
        self.replacements = Replacements(self)
        self.router.explain = self.explain

    # ------------------------------------------------------------------ views
    def live(self) -> dict[int, Any]:
        """Serving engines by index."""
        return self.router.live()

    def load(self) -> dict[int, int]:
        """Requests in flight per serving engine."""
        return self.router.outstanding()

    def draining(self) -> set[int]:
        """Engines being scaled in (serving their in-flight requests, given no new ones)."""
        return self.router.draining()

    def on_reservation(self, index: int) -> bool:
        """Engine ``index`` runs on a configured engine's reservation: present from the start, or the
        replacement of one (the control plane can protect these from scale-in)."""
        with self._lock:
            return self._slots.get(index) is not None

    def metrics(self) -> dict[str, float]:
        """Cumulative ``fault/*`` counters plus the number of serving engines."""
        self.counters.set("resubmitted_requests", float(self.router.resubmitted))
        return {
            **self.counters.metrics(),
            "fault/engines_live": float(len(self.router)),
            "fault/engines_wanted": float(self.shortfall.wanted),
        }

    # ------------------------------------------------------------------ failures
    def evict(self, index: int, reason: str, replace: bool = True) -> None:
        """Stop routing to engine ``index`` and kill it; start a replacement if restarts remain.
        Thread-safe and idempotent (a second report about the same engine does nothing)."""
        handle = self.router.remove_engine(index)
        if handle is None:
            return
        with self._lock:
            slot = self._slots.get(index)
        lost = Lost(
            index, reason, slot, self._places.node_of(handle) if self._places else None
        )  # before the kill
        self._forget(handle)
        kill(handle)
        self.counters.add("engine_evictions")
        if not (
            self.replacements.schedule(lost, reason)
            if replace
            else self.replacements.give_up(lost, reason, "not asked for")
        ):
            self.close_if_empty(reason)

    def close_if_empty(self, reason: str) -> None:
        with self._lock:
            replacing, used = self.replacements.in_progress, self.replacements.started
        if not self.router.live() and not replacing:
            self.router.close(
                NoEnginesLeft(
                    f"{reason}; no rollout engine left (rollout.max_restarts={self.rollout.max_restarts}, {used} used)"
                )
            )

    def explain(self) -> str | None:
        """What the run waits for while engines are missing (the stop message and ``relax status`` say it)."""
        line = self.shortfall.line(len(self.router))
        if line and self._places is not None and self.shortfall.status(0)["waiting"]:
            line += f"; start one with `{self._places.fix()}`"
        return line

    # ------------------------------------------------------------------ starting engines
    def _take_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    def _start(self, indices: list[int], on_phase: PhaseFn | None = None) -> list[Any]:
        """Create engines ``indices``, wait until each is constructed and healthy, sync them to the
        current weights (under ``weights_lock``, one transfer for all) and only then route to them."""
        phase = on_phase or (lambda name, which: None)
        phase("creating", indices)
        if (
            self._places is not None
        ):  # each reservation on an alive node (a lost node's moves once one has room)
            with self._lock:
                slots = {index: self._slots.get(index) for index in indices}
            self._places.await_slots(slots, self.rollout.timeout_s, self._stop)
        handles = [
            self._start_engine(index, self._slots.get(index), **self._overrides(index)) for index in indices
        ]
        try:
            phase("health-checking", indices)
            deadline = time.monotonic() + self.rollout.timeout_s
            for index, handle in zip(indices, handles, strict=True):
                self._await(handle.__ray_ready__.remote(), deadline, f"rollout engine[{index}] did not start")
                if not hasattr(handle, "health"):  # a bare test actor; every RolloutRole has it
                    continue
                health = self._await(
                    handle.health.remote(), deadline, f"rollout engine[{index}] did not answer health"
                )
                if not health.get("ok", True):
                    raise RuntimeError(f"rollout engine[{index}] is unhealthy after start: {health}")
            with self.weights_lock:
                if self._stop.is_set():
                    raise RuntimeError("the run is stopping")
                phase("weight-syncing", indices)
                self.transport.sync(self.trainer, handles, self.version)
                for index, handle in zip(indices, handles, strict=True):
                    self.router.add_engine(handle, index)
                    self.engines.append(handle)
                self._on_change(list(self.engines))
        except BaseException as exc:
            if self._places is not None and handles:  # where it ran: did it die with its node?
                exc.relax_node = self._places.node_of(handles[0])  # type: ignore[attr-defined]
            for handle in handles:
                kill(handle)
            raise
        phase("active", indices)
        return handles

    def _overrides(self, index: int) -> dict[str, Any]:
        with self._lock:
            params = self._params.get(index)
        return {"engine_params": params} if params else {}

    def _await(self, ref: Any, deadline: float, what: str) -> Any:
        while not local.wait([ref], timeout=READY_POLL_S)[0]:
            if self._stop.is_set():
                raise RuntimeError("the run is stopping")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {self.rollout.timeout_s:g}s")
        return local.get(ref)

    def _forget(self, handle: Any) -> None:
        with self._lock:
            self.engines[:] = [h for h in self.engines if h is not handle]
            engines = list(self.engines)
        self._on_change(engines)

    # ------------------------------------------------------------------ control API
    def add_engine(self) -> int:
        """Start one more engine, synced to the current weight version before it serves; returns
        its index. Blocks until it serves (engine start-up is bounded by ``rollout.timeout_s``)."""
        return self.add_engines(1)[0]

    def add_engines(
        self, n: int, on_phase: PhaseFn | None = None, engine_params: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Start ``n`` engines together (one weight transfer for all); returns their new indices once
        they serve. Removed engines' reservations are reused before going outside the reservation.
        ``engine_params``: per new engine, ``rollout.engine_params`` fields of its own (such engines run
        outside the reservation: an attached engine's server runs elsewhere)."""
        if engine_params is not None and len(engine_params) != n:
            raise ValueError(f"engine_params: {len(engine_params)} overrides for {n} engines")
        with self._lock:
            indices = [self._take_index() for _ in range(n)]
            for i, index in enumerate(indices):
                if engine_params is not None:
                    self._params[index] = dict(engine_params[i])
                elif self._free_slots:
                    self._slots[index] = self._free_slots.pop()
            taken = [self._slots[i] for i in indices if self._slots.get(i) is not None]
        # lost engines whose reservations these take: they fill the gap, not add to it
        filled = [i for slot in taken if (i := self.shortfall.orphan_of(slot)) is not None]
        try:
            self._start(indices, on_phase)
        except BaseException:
            with self._lock:
                for index in indices:
                    self._params.pop(index, None)
                    if (slot := self._slots.pop(index, None)) is not None:
                        self._free_slots.append(slot)
            raise
        self.shortfall.added(n, filled)
        log.info("relax: rollout engines %s added; serving: %s", indices, sorted(self.router.live()))
        return indices

    def attach_engines(
        self, urls: list[str], on_phase: PhaseFn | None = None, field: str | None = None
    ) -> list[int]:
        """Add one engine per URL, each attached to that running server, synced to the current weight
        version before it serves; returns their indices. ``field``: the engine's attach field (default:
        what its plugin declared, ``attach_param``)."""
        field = field or attach_param(self.rollout.engine)
        if field is None:
            raise ValueError(
                f"urls: rollout engine {self.rollout.engine!r} cannot attach external engines (its "
                "plugin declares no attach= field); scale out with num_engines"
            )
        return self.add_engines(len(urls), on_phase, engine_params=[{field: [url]} for url in urls])

    def remove_engine(self, index: int, drain_timeout_s: float = 0.0) -> dict[str, Any]:
        """Stop routing new requests to engine ``index``, wait up to ``drain_timeout_s`` for its
        in-flight requests to finish, then kill it; requests still in flight go to the other engines.
        Returns ``{"drained": all finished in time, "forced_requests": how many were still in flight}``."""
        live = self.router.live()
        if index not in live:
            raise KeyError(f"rollout engine[{index}] is not serving; serving: {sorted(live)}")
        if not set(live) - self.router.draining() - {index}:
            raise ValueError(
                f"rollout engine[{index}] is the last serving engine; add one before removing it"
            )
        self.router.drain(index)
        deadline = time.monotonic() + drain_timeout_s
        while (
            self.router.outstanding().get(index, 0) > 0
            and time.monotonic() < deadline
            and not self._stop.is_set()
        ):
            time.sleep(DRAIN_POLL_S)
        forced = self.router.outstanding().get(index, 0)
        handle = self.router.remove_engine(index)
        if handle is not None:
            self._forget(handle)
            kill(handle)
        with self._lock:
            self._params.pop(index, None)
            if (slot := self._slots.pop(index, None)) is not None:
                self._free_slots.append(slot)
        self.shortfall.removed()
        log.info(
            "relax: rollout engine[%d] removed (%s); serving: %s",
            index,
            f"forced with {forced} requests in flight" if forced else "drained",
            sorted(self.router.live()),
        )
        return {"drained": forced == 0, "forced_requests": forced}

    # ------------------------------------------------------------------ calls on every engine
    def control(self, method: str, *args: Any, engines: dict[int, Any] | None = None) -> dict[int, Any]:
        """Call ``method`` on every serving engine (or ``engines``) within ``rollout.control_timeout_s``;
        returns answers by index. A dead or silent engine is evicted; an engine that raises is an error."""
        engines = self.router.live() if engines is None else engines
        timeout = self.rollout.control_timeout_s
        refs = {i: getattr(h, method).remote(*args) for i, h in engines.items()}
        deadline = time.monotonic() + timeout
        answers = {}
        for i, ref in refs.items():
            try:
                answers[i] = local.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                self.evict(i, f"rollout engine[{i}] did not answer {method} within {timeout:g}s")
            except ray.exceptions.RayActorError as exc:
                self.evict(i, f"rollout engine[{i}] died before answering {method} ({describe(exc)})")
            except Exception as exc:  # the engine raised (in its actor or the driver)
                raise RoleError(
                    f"rollout engine[{i}] failed in {method}: {describe(exc)}", "rollout engine", i, method
                ) from exc
        return answers

    def trained(self, version: int) -> None:
        """The trainer's weights are now ``version`` (a step committed, under ``weights_lock``): an
        engine started from now on is synced to them as ``version``."""
        with self.weights_lock:
            self.version = version

    def sync(self, version: int) -> dict[str, float]:
        """Push the trainer's weights, as ``version``, to every serving engine; returns ``weight_sync/*``
        metrics. A sync that fails because an engine died or hangs evicts that engine and is retried
        on the rest; any other failure is raised."""
        with self.weights_lock:
            self.version = version
            while True:
                engines = self.router.live()
                if not engines:  # replacements are synced when they start
                    return {}
                try:
                    stats = self.transport.sync(self.trainer, list(engines.values()), version)
                    return {f"weight_sync/{k}": float(v) for k, v in stats.items()}
                except Exception as exc:
                    answered = self.control("weight_version", engines=engines)
                    if len(answered) == len(engines):
                        raise  # every engine is fine: the transport or the trainer failed
                    log.warning(
                        "relax: weight sync failed (%s); retrying on engines %s",
                        describe(exc),
                        sorted(answered),
                    )

    def publish(self, version: int, abort: bool) -> dict[str, float]:
        """Async modes: pause every engine (no decode step runs), optionally abort in-flight
        requests (they come back as ``abort`` and are resubmitted), ``sync(version)``, resume."""
        with self.weights_lock:
            paused = self.control("pause")
            try:
                if abort:
                    self.control(
                        "abort", engines={i: h for i, h in self.router.live().items() if i in paused}
                    )
                return self.sync(version)
            finally:
                live = self.router.live()
                self.control("resume", engines={i: live[i] for i in paused if i in live})

    def close(self) -> None:
        """Stop replacing engines and wake every stream waiting for one."""
        self._stop.set()
        self.router.close(RuntimeError("the run is shutting down"))
