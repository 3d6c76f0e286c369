"""Waits that take a role in the driver's own process or a Ray actor alike.

``rollout.host: driver`` runs the trainer, its hosted engine and its reward (declared ``in_driver``) inside the
driver: a single-machine colocate run then needs no actor, so it starts no Ray at all (its daemons
and the actor's own torch import were most of the seconds before the first step on a small
machine). The modes keep one call shape: ``handle.method.remote(*args)`` on a
:class:`~relax.core.lazy_ray.LocalHandle` runs the method now and returns a
:class:`~relax.core.lazy_ray.LocalRef` holding its value or its exception (both defined below the
controller, beside the other stand-ins for Ray, so a transport can tell them apart too), and
:func:`get` / :func:`wait` resolve local refs directly and Ray's ``ObjectRef`` through Ray.

A local call cannot be interrupted: the ``timeout_s`` of a wait bounds only actor calls (a local
role runs the run's own code in the driver, as a single-process trainer does).
"""

from __future__ import annotations

from typing import Any

from relax.core.lazy_ray import LocalHandle, LocalRef, call_now, is_local

__all__ = ["LocalHandle", "LocalRef", "call_now", "get", "is_local", "wait"]


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` for ``ObjectRef``s, :class:`LocalRef`s or a list mixing both."""
    if isinstance(refs, LocalRef):
        return refs.result()
    if isinstance(refs, list) and any(isinstance(r, LocalRef) for r in refs):
        remote = [r for r in refs if not isinstance(r, LocalRef)]
        values = iter(_ray().get(remote, timeout=timeout) if remote else [])
        return [r.result() if isinstance(r, LocalRef) else next(values) for r in refs]
    return _ray().get(refs, timeout=timeout)


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """``ray.wait``: local refs are ready at once (and come first)."""
    ready = [r for r in refs if isinstance(r, LocalRef)]
    remote = [r for r in refs if not isinstance(r, LocalRef)]
    if len(ready) >= num_returns or not remote:
        return ready, remote
    done, pending = _ray().wait(remote, num_returns=num_returns - len(ready), timeout=timeout)
    return ready + done, pending


def _ray():
    import ray

    return ray
