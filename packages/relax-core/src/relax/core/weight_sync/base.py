"""What every weight-sync transport shares: calling local objects or Ray actors with a deadline,
naming the engine that failed, pulling buckets from the trainer, and the version handshake.

Trainer and engines may be plain objects (colocated) or Ray actor handles. Calls on plain objects
run in a daemon thread so a stuck receiver costs a leaked thread, never a hung sync.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections.abc import Iterator
from typing import Any

from relax.core.protocols import NamedTensors
from relax.core.weight_sync.flat import ZeroCopyBucket


class WeightSyncError(RuntimeError):
    """A weight transfer failed: an engine died, did not answer in time, or serves the wrong version."""


def is_actor(obj: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a core dependency
        return False
    return isinstance(obj, ActorHandle)


def engine_names(engines: list[Any]) -> list[str]:
    """Stable, human-readable names used in errors: ``engine[1] (RolloutRole actor 3f2a…)``."""
    names = []
    for i, engine in enumerate(engines):
        if is_actor(engine):
            cls = getattr(getattr(engine, "_ray_actor_creation_function_descriptor", None), "class_name", "")
            label = " ".join(filter(None, [cls, "actor", engine._actor_id.hex()[:12]]))
            names.append(f"engine[{i}] ({label})")
        else:
            names.append(f"engine[{i}] ({getattr(engine, 'name', type(engine).__name__)})")
    return names


def _run_local(fn: Any, *args: Any) -> cf.Future:
    future: cf.Future = cf.Future()

    def target() -> None:
        try:
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = asyncio.run(result)
            future.set_result(result)
        except BaseException as exc:  # delivered to the waiter
            future.set_exception(exc)

    threading.Thread(
        target=target, daemon=True, name=f"relax-weight-sync-{getattr(fn, '__name__', 'call')}"
    ).start()
    return future


def start(obj: Any, method: str, *args: Any) -> cf.Future:
    """Begin ``obj.method(*args)`` without waiting; works for Ray actors and local objects alike."""
    if is_actor(obj):
        return getattr(obj, method).remote(*args).future()
    return _run_local(getattr(obj, method), *args)


def wait_all(pending: dict[str, cf.Future], timeout_s: float, what: str) -> dict[str, Any]:
    """Results by name; the first failure or the deadline raises ``WeightSyncError`` naming the engine(s)."""
    deadline = time.monotonic() + timeout_s
    results: dict[str, Any] = {}
    left = dict(pending)
    while left:
        done, _ = cf.wait(
            left.values(), timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED
        )
        if not done:
            raise WeightSyncError(f"{', '.join(left)} did not finish {what} within {timeout_s:g}s")
        for name, fut in list(left.items()):
            if fut in done:
                del left[name]
                try:
                    results[name] = fut.result()
                except Exception as exc:
                    raise WeightSyncError(f"{name} failed during {what}: {describe_error(exc)}") from exc
    return results


def describe_error(exc: BaseException) -> str:
    import ray.exceptions

    if isinstance(exc, ray.exceptions.RayActorError):
        return "actor died"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def call_all(
    engines: list[Any], names: list[str], method: str, args: tuple, timeout_s: float, what: str
) -> dict[str, Any]:
    return wait_all(
        {n: start(e, method, *args) for n, e in zip(names, engines, strict=True)}, timeout_s, what
    )


def iter_buckets(trainer: Any, bucket_bytes: int, timeout_s: float) -> Iterator[NamedTensors]:
    """The trainer's exported buckets, materialised in this process. An actor trainer's
    ``export_weights`` may be a generator (streamed bucket by bucket) or return a list of buckets."""
    if not is_actor(trainer):
        yield from trainer.export_weights(bucket_bytes)
        return
    import ray

    try:
        if getattr(trainer.export_weights, "_is_generator", False):
            for ref, _ in iter_bucket_refs(trainer, bucket_bytes, timeout_s):
                yield ray.get(ref, timeout=timeout_s)
        else:
            yield from ray.get(trainer.export_weights.remote(bucket_bytes), timeout=timeout_s)
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(f"trainer failed to export weights: {describe_error(exc)}") from exc


def iter_bucket_refs(trainer: Any, bucket_bytes: int, timeout_s: float) -> Iterator[tuple[Any, int]]:
    """(ObjectRef, bytes) per trainer bucket. An actor trainer whose ``export_weights`` is a generator
    streams them (already in the object store, one put per bucket; bytes = serialized size). Other
    trainers' buckets are ``ray.put`` here as :class:`ZeroCopyBucket` (read zero-copy by engines)."""
    import ray

    method = trainer.export_weights
    if not (is_actor(trainer) and getattr(method, "_is_generator", False)):
        for bucket in iter_buckets(trainer, bucket_bytes, timeout_s):
            yield ray.put(ZeroCopyBucket(bucket)), bucket_nbytes(bucket)
        return
    stream = method.options(num_returns="streaming").remote(bucket_bytes)
    while True:
        try:
            ref = stream._next_sync(timeout_s)  # public iteration has no timeout
        except StopIteration:
            return
        if ref.is_nil():
            raise WeightSyncError(f"trainer did not export the next weight bucket within {timeout_s:g}s")
        yield ref, ray.experimental.get_object_locations([ref])[ref]["object_size"]


def bucket_nbytes(bucket: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def verify_versions(engines: list[Any], names: list[str], version: int, timeout_s: float) -> None:
    """Version handshake: every engine must now serve ``version``; a mixed fleet is an error."""
    served = call_all(engines, names, "weight_version", (), timeout_s, "weight_version")
    wrong = {n: v for n, v in served.items() if v != version}
    if wrong:
        raise WeightSyncError(
            f"engines disagree after the update to version {version}: {served} (wrong: {sorted(wrong)})"
        )


def stats(start_time: float, nbytes: int, buckets: int, engines: int) -> dict[str, float]:
    seconds = time.perf_counter() - start_time
    return {
        "seconds": seconds,
        "bytes": float(nbytes),
        "bytes_per_s": nbytes / seconds if seconds > 0 else 0.0,
        "buckets": float(buckets),
        "engines": float(engines),
    }
