"""Roles in the driver's own process, called like Ray actors, and waits that take either kind.

``rollout.host: driver`` runs the trainer, its hosted engine and a built-in rule reward inside the
driver: a single-machine colocate run then needs no actor, so it starts no Ray at all (its daemons
and the actor's own torch import were most of the seconds before the first step on a small
machine). The modes keep one call shape: ``handle.method.remote(*args)`` on a :class:`LocalHandle`
runs the method now and returns a :class:`LocalRef` holding its value or its exception, and
:func:`get` / :func:`wait` resolve local refs directly and Ray's ``ObjectRef`` through Ray.

A local call cannot be interrupted: the ``timeout_s`` of a wait bounds only actor calls (a local
role runs the run's own code in the driver, as a single-process trainer does).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any


class LocalRef:
    """The outcome of a call already made in this process: its value, or the exception it raised."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def future(self) -> cf.Future:
        """A finished ``concurrent.futures.Future`` (as ``ObjectRef.future()`` gives for an actor call)."""
        fut: cf.Future = cf.Future()
        if self.error is not None:
            fut.set_exception(self.error)
        else:
            fut.set_result(self.value)
        return fut


def call_now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> LocalRef:
    try:
        return LocalRef(fn(*args, **kwargs))
    except Exception as exc:  # delivered by get(), where an actor's error would surface
        return LocalRef(error=exc)


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return call_now(self.fn, *args, **kwargs)


class LocalHandle:
    """``obj``'s methods called like an actor handle's (``handle.m.remote(...)`` -> :class:`LocalRef`)."""

    def __init__(self, obj: Any) -> None:
        self.local = obj
        self.__ray_ready__ = _Method(lambda: True)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(getattr(self.local, name))

    def __repr__(self) -> str:
        return f"LocalHandle({type(self.local).__name__})"


def is_local(handle: Any) -> bool:
    return isinstance(handle, LocalHandle)


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
