"""The end of a run, completed or failed: every plugin object with ``close()`` is closed.

Each process closes what it holds. A role (actor, or object in the driver) closes its plugin
object -- engine, trainer, reward -- and the weight-sync sides built in its process (a sender's
temporary directory, a receiver's process group: ``weight_sync.transport.release_sides``), through
its ``close()`` endpoint (:func:`close_held`). The driver asks every role to do so within a deadline
(:func:`close_roles`), then kills the actors and closes its own transport and queue. One failing
close is logged and never stops the others (:func:`run_all`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("relax")


def run_all(parts: Iterable[tuple[str, Callable[[], Any] | None]]) -> None:
    """Call each part in order; a failure is logged (naming the part) and the next part still runs."""
    for what, fn in parts:
        if fn is None:
            continue
        try:
            fn()
        except Exception as exc:  # shutting down: report, go on
            log.warning("relax: closing %s failed: %s: %s", what, type(exc).__name__, exc)


def close_plugin(obj: Any) -> None:
    """``obj.close()`` if it has one (plugins need not)."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def close_held(host: Any, *plugins: Any) -> None:
    """In a role's process: close its plugin objects, then the weight-sync sides built there."""
    from relax.core.weight_sync.transport import release_sides

    run_all(
        [
            *((type(p).__name__, lambda p=p: close_plugin(p)) for p in plugins if p is not None),
            ("weight-sync sides", lambda: release_sides(host)),
        ]
    )


def close_roles(handles: Iterable[Any], timeout_s: float) -> None:
    """Ask each role (actor handle, or a role object in the driver) to close what it holds, all at
    once, waiting at most ``timeout_s`` in all; a dead, silent or failing role is logged and skipped."""
    from relax.core.controller import local

    pending = []
    for handle in _distinct(handles):
        try:
            pending.append((handle, handle.close.remote()))
        except AttributeError:  # a role without the endpoint (a test double): nothing to close
            continue
    deadline = time.monotonic() + timeout_s
    for handle, ref in pending:
        try:
            local.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # dead, silent, or its close failed: the actor is killed next anyway
            log.warning(
                "relax: closing %r at the end of the run failed: %s: %s", handle, type(exc).__name__, exc
            )


def _distinct(handles: Iterable[Any]) -> list[Any]:
    """Each handle once (a trainer-hosted engine is the trainer's own handle)."""
    seen: list[Any] = []
    for h in handles:
        if h is not None and not any(h is s or _same_actor(h, s) for s in seen):
            seen.append(h)
    return seen


def _same_actor(a: Any, b: Any) -> bool:
    from relax.core.weight_sync.base import is_actor

    return is_actor(a) and is_actor(b) and a == b
