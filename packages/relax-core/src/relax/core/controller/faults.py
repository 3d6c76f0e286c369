"""Bounded waits on role actors, and the errors and counters of fault handling.

Every blocking call the driver makes on a role goes through :func:`wait`: it has a deadline from
config and, on failure, raises an error that names the role, its index and the operation
("rollout engine[1] did not answer pause within 10s"), so a stuck or dead actor is never a silent
hang and never a bare ``GetTimeoutError`` / ``ActorDiedError``.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import ray

from relax.core.controller import local

log = logging.getLogger("relax")


class RoleError(RuntimeError):
    """A role actor failed an operation; ``role`` / ``index`` / ``op`` say which and where."""

    def __init__(self, message: str, role: str = "", index: int | None = None, op: str = "") -> None:
        super().__init__(message)
        self.role, self.index, self.op = role, index, op


class RoleTimeout(RoleError, TimeoutError):
    """The role did not answer within its configured timeout (stuck, stopped or overloaded)."""


class RoleDied(RoleError):
    """The role's actor process is gone."""


class NoEnginesLeft(RuntimeError):
    """Every rollout engine was lost and ``rollout.max_restarts`` allows no more replacements."""


def role_label(role: str, index: int | None = None) -> str:
    """``rollout engine[1]``, ``trainer``, ``reference`` -- the name errors and logs use."""
    return f"{role}[{index}]" if index is not None else role


def is_dead(exc: BaseException) -> bool:
    """True for errors meaning the actor process is gone (killed, crashed, node lost)."""
    return isinstance(exc, ray.exceptions.RayActorError)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a role actually raised: Ray's ``RayTaskError`` wrappers (one per actor hop)
    peeled off; anything else is returned as is."""
    seen = 0
    while isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, BaseException) and seen < 16:
        exc, seen = exc.cause, seen + 1
    return exc


def describe(exc: BaseException) -> str:
    """One line for an actor failure: ``actor died`` or the remote exception's last line."""
    if is_dead(exc) and not getattr(exc, "actor_init_failed", False):
        return "actor died"
    if is_dead(exc):  # its constructor raised: the message ends with that exception
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return f"failed to start: {lines[-1].strip() if lines else 'constructor raised'}"
    exc = root_cause(exc) if isinstance(exc, ray.exceptions.RayTaskError) else exc
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def wait(refs: Any, timeout_s: float, role: str, op: str, index: int | None = None) -> Any:
    """``ray.get(refs)`` within ``timeout_s``; timeouts and deaths become :class:`RoleTimeout` /
    :class:`RoleDied` naming ``role[index]`` and ``op``; an exception raised inside the actor keeps
    its type (Ray's error is also an instance of it) and gets the role named in a note."""
    who = role_label(role, index)
    try:
        return local.get(refs, timeout=timeout_s)  # a role in the driver (controller.local) answered already
    except ray.exceptions.GetTimeoutError:
        raise RoleTimeout(f"{who} did not answer {op} within {timeout_s:g}s", role, index, op) from None
    except ray.exceptions.RayActorError as exc:
        if getattr(exc, "actor_init_failed", False):  # keep the constructor's error (bad path, config...)
            exc.add_note(f"(raised by {who} in {op})")
            raise
        raise RoleDied(f"{who} died during {op} ({describe(exc)})", role, index, op) from exc
    except ray.exceptions.RayTaskError as exc:  # also an instance of the remote exception's type
        exc.add_note(f"(raised by {who} in {op})")
        raise
    except Exception as exc:  # raised by a role in the driver: the same note
        if (
            isinstance(refs, local.LocalRef)
            or isinstance(refs, list)
            and any(isinstance(r, local.LocalRef) for r in refs)
        ):
            exc.add_note(f"(raised by {who} in {op})")
        raise


def reward_timeout(cfg: Any, n_samples: int) -> float:
    """Bound for one reward-role call scoring ``n_samples``: the per-sample timeout for every wave of
    ``reward.max_concurrency`` samples, plus ``rollout.control_timeout_s`` of slack for the call itself."""
    waves = math.ceil(max(n_samples, 1) / max(cfg.reward.max_concurrency, 1))
    return waves * cfg.reward.timeout_s + cfg.rollout.control_timeout_s


def alive(handle: Any, timeout_s: float) -> bool:
    """Whether an actor is alive. Asks Ray's control store (the actor need not answer: a busy
    trainer is alive); falls back to a ``__ray_ready__`` call within ``timeout_s``. A role in the
    driver lives as long as the driver."""
    if local.is_local(handle):
        return True
    try:
        from ray._private.state import actors  # no public API without the dashboard

        info = actors(actor_id=handle._actor_id.hex())
        if info:
            return info.get("State") not in ("DEAD", "DEPENDENCIES_UNREADY")
    except Exception as exc:  # fall back to asking the actor
        log.debug("actor state lookup failed: %s", exc)
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except Exception:
        return False


class FaultCounters:
    """Cumulative, thread-safe counts of recoveries, logged as ``fault/<name>`` every step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0.0)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f"fault/{k}": v for k, v in sorted(self._values.items())}
