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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
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

            self._made = ray.remote(**self._options)(self.__ray_actor_class__) if self._options else ray.remote(
                self.__ray_actor_class__
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
