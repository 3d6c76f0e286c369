"""The run as plugins see it (``relax_on_run_start`` / ``relax_on_run_end``), and the control
object through which they steer it.

Control requests may come from any thread (a plugin's HTTP server, a timer); the driver applies
them between steps, so a step never sees its engine set or weights change under it. Each request
returns a ``concurrent.futures.Future`` that resolves once the driver has applied it.

Scale operations (``scale_out`` / ``scale_in``, used by the control plane) run at once in a thread
of their own instead, as engine replacements do: the run keeps training while an engine loads or
drains, and a new engine is still synced to the current weights (under the fleet's weights lock)
before it serves.
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
        self._state: Any = None  # the run, for scale operations (``attach``)

    def attach(self, state: Any) -> None:
        self._state = state

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

    def scale_out(
        self, n: int, on_phase: Callable[[str, list[int]], None] | None = None, urls: list[str] | None = None
    ) -> cf.Future:
        """Start ``n`` rollout engines now -- with ``urls``, one attached to each running server instead
        (``EngineFleet.attach_engines``); ``on_phase(phase, indices)`` reports "creating",
        "health-checking", "weight-syncing", "active". Resolves to their indices once they serve."""
        if urls:
            return self._in_thread(
                f"scale_out({urls})", lambda state: state.fleet.attach_engines(urls, on_phase)
            )
        return self._in_thread(f"scale_out({n})", lambda state: state.fleet.add_engines(n, on_phase))

    def scale_in(self, index: int, drain_timeout_s: float) -> cf.Future:
        """Drain engine ``index`` (no new requests; in-flight ones finish for up to ``drain_timeout_s``),
        then stop it. Resolves to ``{"drained": bool, "forced_requests": int}``."""
        return self._in_thread(
            f"scale_in({index})", lambda state: state.fleet.remove_engine(index, drain_timeout_s)
        )

    def _in_thread(self, what: str, fn: Callable[[Any], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        state = self._state
        if state is None:
            future.set_exception(RuntimeError(f"control: {what}: no run attached"))
            return future

        threading.Thread(
            target=_resolve, args=(future, what, fn, state), name=f"relax-control-{what}", daemon=True
        ).start()
        return future

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
                _resolve(future, what, fn, state)
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


def _resolve(future: cf.Future, what: str, fn: Callable[[Any], Any], state: Any) -> None:
    """Run request ``what`` into its future (unless cancelled); the requester gets any error and
    the run goes on."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(state))
        log.info("control: %s done", what)
    except Exception as exc:
        log.error("control: %s failed: %s", what, exc)
        future.set_exception(exc)


class RunHandle:
    """Read-only view of a run plus its :class:`RunControl`."""

    def __init__(self, state: Any, control: RunControl) -> None:
        self._state = state
        self.control = control
        control.attach(state)

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
    def mode(self) -> str:
        return self._state.cfg.mode

    @property
    def trainer_idle_frac(self) -> float | None:
        """Fraction of the latest step the trainer waited for rollouts (async/hybrid; None before a step)."""
        return self._state.last_metrics.get("perf/trainer_idle_frac")

    def queue_metrics(self) -> dict[str, float]:
        """Transfer-queue gauges now (``queue/rows``, ``queue/capacity``, ``queue/depth/<column>``, ...);
        empty before the async pipeline starts and in colocate mode."""
        pipeline = getattr(self._state, "pipeline", None)
        if pipeline is None:
            return {}
        return {k: float(v) for k, v in pipeline.queue.metrics().items()}

    def engine_load(self) -> dict[int, int]:
        """Requests in flight per serving engine."""
        return self._state.fleet.load()

    def engines_draining(self) -> set[int]:
        return self._state.fleet.draining()

    def engine_on_reservation(self, index: int) -> bool:
        """Engine ``index`` is one present from the start (or replaces one)."""
        return self._state.fleet.on_reservation(index)

    @property
    def engine_indices(self) -> list[int]:
        """Indices of the engines serving now (stable; a replacement gets a new index)."""
        return sorted(self._state.fleet.live())

    def engine_shortfall(self) -> dict[str, Any]:
        """Engines live of wanted, what each missing one waits for (label, resources, since when) and
        which will not come back and why; ``line``: all of it in one sentence (None: nothing missing)."""
        fleet = self._state.fleet
        return {**fleet.shortfall.status(len(fleet.live())), "line": fleet.explain()}

    def engine_nodes(self) -> dict[int, str | None]:
        """The address of the Ray node each serving engine runs on (None: in the driver, or not known yet)."""
        from relax.core.weight_sync.base import is_actor
        from relax.core.weight_sync.nodes import actor_node, node_address

        return {
            i: node_address(actor_node(h)) if is_actor(h) else None
            for i, h in self._state.fleet.live().items()
        }

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
                out.append(
                    {"engine_index": index, **ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))}
                )
            except Exception as exc:  # dead or stuck: say so, never hang the caller
                out.append({"engine_index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return out
