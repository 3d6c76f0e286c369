"""SIGINT / SIGTERM in the driver: stop promptly, save what can be saved, always clean up.

The first signal interrupts the run (:class:`Interrupted`, a ``KeyboardInterrupt``), which then
saves an emergency checkpoint and tears Ray down. Signals after that never interrupt the cleanup
(an interrupted ``ray.shutdown()`` is what leaves Ray processes behind): a second one skips the
emergency checkpoint, later ones only say that cleanup is under way, and a fourth forces the
exit after killing Ray's processes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)
FORCE_AFTER = 4  # signals before the driver kills Ray's processes and exits at once


class Interrupted(KeyboardInterrupt):
    """The driver received SIGINT or SIGTERM; ``signame`` says which."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


class SignalGuard:
    """Phases: ``run`` (a signal raises :class:`Interrupted`), ``checkpoint`` (a signal raises
    again: the emergency checkpoint is skipped), ``cleanup`` (signals only print)."""

    def __init__(self) -> None:
        self.phase = "run"
        self.count = 0
        self.signame: str | None = None
        self.skip_checkpoint = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in HANDLED:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _say(self, text: str) -> None:
        print(f"relax: {text}", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        self.signame = self.signame or name
        if self.phase == "run":
            self.phase = "stopping"
            self._say(
                f"{name} received: stopping; an emergency checkpoint is saved if possible (Ctrl-C again to skip it)"
            )
            raise Interrupted(name)
        if self.phase == "checkpoint":
            self.phase, self.skip_checkpoint = "cleanup", True
            self._say(f"{name} again: skipping the emergency checkpoint; shutting Ray down")
            raise Interrupted(name)
        self.skip_checkpoint = True
        if self.count >= FORCE_AFTER:
            self._say(f"{name} x{self.count}: killing Ray's processes and exiting now")
            from relax.core.controller.teardown import ray_processes, reap

            reap(ray_processes(), grace_s=0.0)
            os._exit(128 + signum)
        self._say(
            f"{name} again: still shutting Ray down cleanly (a few seconds; {FORCE_AFTER - self.count} more to force)"
        )


_current: SignalGuard | None = None


def current() -> SignalGuard | None:
    """The guard of the run in progress (None outside ``run`` or off the main thread)."""
    return _current


@contextmanager
def guarded() -> Iterator[SignalGuard | None]:
    """Install a :class:`SignalGuard` for the duration (main thread only; elsewhere yields None)."""
    global _current
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    guard, previous = SignalGuard(), _current
    guard.install()
    _current = guard
    try:
        yield guard
    finally:
        _current = previous
        guard.restore()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Run a block in phase ``checkpoint`` or ``cleanup`` of the current guard (if any)."""
    guard = _current
    if guard is None:
        yield
        return
    if name == "checkpoint" and guard.phase in ("run", "stopping"):
        guard.phase = "checkpoint"
    elif name == "cleanup":
        guard.phase = "cleanup"
    try:
        yield
    finally:
        if guard.phase == "checkpoint":
            guard.phase = "stopping"
