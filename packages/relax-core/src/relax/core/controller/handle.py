"""The run as plugins see it (``relax_on_run_start`` / ``relax_on_run_end``), and the control
object through which they steer it.

Control requests may come from any thread (a plugin's HTTP server, a timer); the driver applies
them between steps, so a step never sees its engine set or weights change under it. Each request
returns a ``concurrent.futures.Future`` that resolves once the driver has applied it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("relax")


class RunControl:
    """Pause/resume, checkpoint on request, add/remove rollout engines -- all between steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Callable[[Any], Any], cf.Future]] = []
        self._running = threading.Event()
        self._running.set()
        self._wake = threading.Event()

    # ------------------------------------------------------------------ requests (any thread)
    def pause(self) -> None:
        """Stop starting new steps (the current step finishes) until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def request_checkpoint(self) -> cf.Future:
        """Save a checkpoint after the current step; resolves to its directory."""
        return self._submit("checkpoint", lambda state: state.save_checkpoint())

    def add_engine(self) -> cf.Future:
        """Start one more rollout engine, synced to the current weight version before it serves;
        resolves to its engine index."""
        return self._submit("add_engine", lambda state: state.add_engine())

    def remove_engine(self, index: int) -> cf.Future:
        """Drain and stop engine ``index`` (its in-flight requests go to the other engines)."""
        return self._submit(f"remove_engine({index})", lambda state: state.remove_engine(index))

    def _submit(self, what: str, fn: Callable[[Any], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            self._pending.append((what, fn, future))
        self._wake.set()
        return future

    # ------------------------------------------------------------------ the driver's side
    def apply(self, state: Any, poll_s: float = 0.5) -> None:
        """Run queued requests against ``state``; while paused, keep serving requests and wait.
        Called by the run loop before every step."""
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
                self._wake.clear()
            for what, fn, future in pending:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(state))
                    log.info("control: %s done", what)
                except Exception as exc:  # the requester gets the error; the run goes on
                    log.error("control: %s failed: %s", what, exc)
                    future.set_exception(exc)
            if self._running.is_set():
                return
            self._wake.wait(poll_s)

    def cancel_pending(self, reason: str) -> None:
        """Fail every request not yet applied (the run ended)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for what, _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(f"control: {what} not applied: {reason}"))


class RunHandle:
    """Read-only view of a run plus its :class:`RunControl`."""

    def __init__(self, state: Any, control: RunControl) -> None:
        self._state = state
        self.control = control

    @property
    def config(self) -> Any:
        return self._state.cfg

    @property
    def run_dir(self) -> Path:
        return self._state.run_dir

    @property
    def step(self) -> int:
        return self._state.step

    @property
    def weight_version(self) -> int:
        return self._state.version

    @property
    def metrics(self) -> dict[str, float]:
        """The latest step's metrics (a copy)."""
        return dict(self._state.last_metrics)

    @property
    def engine_indices(self) -> list[int]:
        """Indices of the engines serving now (stable; a replacement gets a new index)."""
        return sorted(self._state.fleet.live())

    def engine_health(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """``health()`` of every serving rollout engine, by index order; an engine that does not
        answer in time reports ``{"ok": False, "error": ...}`` instead of blocking the caller."""
        import time

        import ray

        engines = sorted(self._state.fleet.live().items())
        refs = [engine.health.remote() for _, engine in engines]
        deadline = time.monotonic() + timeout_s
        out = []
        for (index, _), ref in zip(engines, refs, strict=True):
            try:
                out.append({"engine_index": index, **ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))})
            except Exception as exc:  # dead or stuck: say so, never hang the caller
                out.append({"engine_index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return out
