"""Calls with a deadline that name the engine that failed; shared by every transport.

Engines may be Ray actor handles or plain local objects (colocated, tests). Calls on plain objects
run in a daemon thread, so a stuck receiver costs a leaked thread, never a hung sync.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from typing import Any

from relax.core.protocols import NamedTensors


class WeightSyncError(RuntimeError):
    """A weight transfer failed: an engine died, did not answer in time, or serves the wrong version."""


def is_actor(obj: Any) -> bool:
    from relax.core import lazy_ray

    if not lazy_ray.imported():  # no actor handle exists without Ray: do not import it to find out
        return False
    from ray.actor import ActorHandle

    return isinstance(obj, ActorHandle)


def actor_label(handle: Any) -> str:
    """``RolloutRole actor 3f2a…``: class name and actor id, readable in any process holding the handle."""
    cls = getattr(getattr(handle, "_ray_actor_creation_function_descriptor", None), "class_name", "")
    return " ".join(filter(None, [cls, "actor", handle._actor_id.hex()[:12]]))


def engine_names(engines: list[Any]) -> list[str]:
    """Stable, human-readable names used in errors: ``engine[1] (RolloutRole actor 3f2a…)``."""
    return [
        f"engine[{i}] ({actor_label(e) if is_actor(e) else getattr(e, 'name', type(e).__name__)})"
        for i, e in enumerate(engines)
    ]


def run_local(fn: Any, *args: Any) -> cf.Future:
    """``fn(*args)`` in a daemon thread (coroutines are run to completion there)."""
    future: cf.Future = cf.Future()

    def target() -> None:
        try:
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = asyncio.run(result)
            future.set_result(result)
        except BaseException as exc:  # delivered to the waiter
            future.set_exception(exc)

    name = f"relax-weight-sync-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=target, daemon=True, name=name).start()
    return future


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
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def bucket_nbytes(bucket: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def check_versions(served: dict[str, int], version: int) -> None:
    """Version handshake: every engine must now serve ``version``; a mixed fleet is an error."""
    wrong = {n: v for n, v in served.items() if v != version}
    if wrong:
        raise WeightSyncError(
            f"engines disagree after the update to version {version}: {served} (wrong: {sorted(wrong)})"
        )


def stats(seconds: float, nbytes: int, buckets: int, engines: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "bytes": float(nbytes),
        "bytes_per_s": nbytes / seconds if seconds > 0 else 0.0,
        "buckets": float(buckets),
        "engines": float(engines),
    }
