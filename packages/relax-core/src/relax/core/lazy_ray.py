"""Ray imported on first use, so a run that needs none (``rollout.host: driver``) never pays for it.

``import ray`` costs about 0.4 s on the development machine -- a tenth of the quick-start's start.
:func:`defer_import` puts a stand-in ``ray`` module in ``sys.modules``: ``import ray`` statements
bind it for free, and the real import runs on the first access to anything the stand-in lacks,
which it forwards from then on. It carries ``ray``'s ``__file__`` / ``__spec__`` / ``__loader__`` so
that scans of ``sys.modules`` (``inspect.getmodule``, which torch runs while it registers operators)
do not trigger the import; the standard library's ``LazyLoader`` loads on any attribute. Modules on
the driver's path therefore touch ``ray`` only inside functions (an ``except ray.exceptions...``
clause is evaluated only when an exception reaches it), and declare their actors and remote
functions with :func:`remote`, which calls ``ray.remote`` on first use instead of at import.

A role that runs in the driver itself (``rollout.host: driver``) is called through a
:class:`LocalHandle`, the stand-in for an actor handle: ``handle.method.remote(*args)`` runs the
method now and returns a :class:`LocalRef` (resolved by ``relax.core.controller.local.get``).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any


class _Deferred(types.ModuleType):
    """The stand-in: identity attributes of its own; anything else imports Ray and is read from it."""

    def __getattr__(self, name: str) -> Any:
        if sys.modules.get("ray") is self:
            del sys.modules["ray"]
            try:
                real = importlib.import_module("ray")
            except BaseException:
                sys.modules["ray"] = self
                raise
            self.__dict__["_real"] = real
        real = self.__dict__.get("_real")
        if real is None:  # another module object replaced the stand-in without loading through it
            real = importlib.import_module("ray")
        return getattr(real, name)


def defer_import() -> None:
    """Make ``import ray`` deferred (nothing to do once Ray is imported, or if it is missing)."""
    if "ray" in sys.modules:
        return
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return
    stand_in = _Deferred("ray")
    stand_in.__dict__.update(__spec__=spec, __loader__=spec.loader, __file__=spec.origin, __package__="ray")
    sys.modules["ray"] = stand_in


def imported() -> bool:
    """Whether Ray's own import has run in this process (an untouched stand-in does not count)."""
    module = sys.modules.get("ray")
    return module is not None and not isinstance(module, _Deferred)


class LazyRemote:
    """``ray.remote(**options)(target)`` made on first use, with the ``remote`` / ``options``
    methods and the ``__ray_actor_class__`` (the plain class) of what it stands for."""

    def __init__(self, target: Any, options: dict[str, Any]) -> None:
        self.__ray_actor_class__ = target
        self.__name__ = self.__qualname__ = target.__name__
        self.__doc__ = target.__doc__
        self._options = options
        self._made: Any = None

    def _remote(self) -> Any:
        if self._made is None:
            import ray

            self._made = (
                ray.remote(**self._options)(self.__ray_actor_class__)
                if self._options
                else ray.remote(self.__ray_actor_class__)
            )
        return self._made

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote().remote(*args, **kwargs)

    def options(self, **options: Any) -> Any:
        return self._remote().options(**options)


def remote(target: Any = None, **options: Any) -> Any:
    """``@remote`` / ``@remote(num_cpus=0)``: like ``@ray.remote``, without importing Ray until used."""
    if target is None:
        return lambda t: LazyRemote(t, options)
    return LazyRemote(target, options)


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
