"""The driver's side of the control plane: publish the run's state to the hub, carry out the
operations queued there, run the autoscaler policy, and notify.

One thread ticks every ``control.publish_s``: it builds a snapshot of the run, hands it to the
hub, and receives the commands queued since the last tick (so the HTTP side never blocks on the
driver). Scale operations run in their own threads (``RunControl.scale_out`` / ``scale_in``) and
report their phases back to the hub.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from relax.core.control.autoscaler import Autoscaler, Decision, Observation, queue_fill
from relax.core.plugins import attach_param

log = logging.getLogger("relax")

HUB_TIMEOUT_S = 30.0
SETTLE_S = 120.0  # longest the run's end waits for a scale operation in flight (no Ray call may outlive Ray)
HEALTH_TIMEOUT_S = 5.0
DECISIONS_KEPT = 50


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    """JSON has no NaN/inf: drop them (and anything non-numeric)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


def snapshot(run: Any, protect: bool, attach: bool, state: str | None = None) -> dict[str, Any]:
    """What ``GET /status`` shows, read from the run handle."""
    load, draining, nodes = run.engine_load(), run.engines_draining(), run.engine_nodes()
    engines = []
    for h in run.engine_health(timeout_s=HEALTH_TIMEOUT_S):
        i = h["engine_index"]
        engines.append(
            {
                "engine_id": i,
                "healthy": bool(h.get("ok")),
                "weight_version": h.get("weight_version"),
                "node": nodes.get(i),
                "load": load.get(i, 0),
                "draining": i in draining,
                "protected": protect and run.engine_on_reservation(i),
                "error": h.get("error"),
            }
        )
    queue = _finite(run.queue_metrics())
    cfg = run.config
    return {
        "name": cfg.name,
        "state": state or ("paused" if run.control.paused else "running"),
        "mode": cfg.mode,
        "engine": cfg.rollout.engine,
        "attach": attach,
        "step": run.step,
        "total_steps": cfg.total_steps,
        "weight_version": run.weight_version,
        "engines": engines,
        "trainer_idle_frac": run.trainer_idle_frac,
        "fleet": run.engine_shortfall(),  # engines live of wanted; what a missing one waits for
        "queue": {
            "rows": queue.get("queue/rows"),
            "capacity": queue.get("queue/capacity"),
            "depth": {
                k.removeprefix("queue/depth/"): v for k, v in queue.items() if k.startswith("queue/depth/")
            },
        },
        "metrics": _finite(run.metrics),
        "updated": time.time(),
    }


class ControlAgent:
    def __init__(self, run: Any, hub: Any, notify: Callable[[str, str], None] | None = None) -> None:
        self.run, self.hub, self.cfg = run, hub, run.config.control
        self.notify = notify or (lambda event, body: None)
        self.autoscaler = Autoscaler(self.cfg.autoscaler) if self.cfg.autoscaler.enabled else None
        # scale-out by URL is offered when the engine's plugin declares an attach field
        self.attach = attach_param(run.config.rollout.engine) is not None
        self.decisions: list[dict[str, Any]] = []
        self.busy = threading.Event()  # a scale operation is running
        self.idle = threading.Event()  # ... and its opposite, to wait on at the end
        self.idle.set()
        self._seen_step = run.step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="relax-control-agent", daemon=True)

    def start(self) -> ControlAgent:
        self.exchange()  # the API answers with real state from the first request on
        self._thread.start()
        return self

    def close(self, status: str) -> None:
        """Stop ticking; publish the final state (operations not taken are cancelled by the hub)."""
        self._stop.set()
        self._thread.join(timeout=HUB_TIMEOUT_S)
        if not self.idle.wait(SETTLE_S):  # its thread must not call Ray after the run shuts Ray down
            log.warning("control: a scale operation was still running at the end of the run")
        try:
            ray.get(self.hub.finish.remote(status, self._snapshot("finished")), timeout=HUB_TIMEOUT_S)
        except Exception as exc:  # the hub may be gone with Ray
            log.debug("control: final publish failed: %s", exc)

    # ------------------------------------------------------------------ ticking
    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.publish_s):
            try:
                self.exchange()
            except Exception as exc:  # keep serving: one failed tick is not a failed run
                log.warning("control: tick failed: %s", exc)

    def _snapshot(self, state: str | None = None) -> dict[str, Any]:
        out = snapshot(self.run, self.cfg.protect_initial_engines, attach=self.attach, state=state)
        out["autoscaler"] = {"enabled": self.autoscaler is not None, "decisions": self.decisions[-10:]}
        return out

    def exchange(self) -> None:
        snap = self._snapshot()
        for command in ray.get(self.hub.exchange.remote(snap), timeout=HUB_TIMEOUT_S):
            self.execute(command)
        if self.autoscaler is not None and snap["step"] != self._seen_step:
            self._seen_step = snap["step"]
            self._autoscale(snap)

    def update(self, op_id: str, state: str, **fields: Any) -> None:
        self.hub.update.remote(op_id, state, **fields)  # calls from one process apply in order

    # ------------------------------------------------------------------ operations
    def execute(self, command: dict[str, Any]) -> None:
        op, kind, request = command["op"], command["kind"], command["request"]
        control = self.run.control
        log.info("control: %s %s %s", op, kind, request)
        if kind in ("pause", "resume"):
            getattr(control, kind)()
            self.update(op, "done")
        elif kind == "checkpoint":
            self.update(op, "saving")
            control.request_checkpoint().add_done_callback(
                lambda f: self._finish(op, f, lambda path: {"result": {"path": str(path)}})
            )
        elif kind == "scale_out":
            self.busy.set()
            self.idle.clear()
            urls = request.get("urls")
            future = control.scale_out(
                len(urls) if urls else request["num_engines"],
                urls=urls,
                on_phase=lambda phase, ids: self.update(op, phase, engine_ids=ids),
            )
            future.add_done_callback(
                lambda f: self._finish(op, f, lambda ids: {"engine_ids": ids}, "scale_out")
            )
        elif kind == "scale_in":
            self.busy.set()
            self.idle.clear()
            self.update(op, "draining")
            timeout = request.get("drain_timeout_s", self.cfg.drain_timeout_s)
            futures = {i: control.scale_in(i, timeout) for i in request["engine_ids"]}  # drain together
            threading.Thread(target=self._await_scale_in, args=(op, futures), daemon=True).start()

    def _await_scale_in(self, op: str, futures: dict[int, Any]) -> None:
        results, errors = {}, []
        for index, future in futures.items():
            try:
                results[str(index)] = future.result()
            except Exception as exc:
                errors.append(f"engine {index}: {exc}")
        done: Any = _Done(results, errors)
        self._finish(op, done, lambda r: {"result": {"engines": r}}, "scale_in")

    def _finish(self, op: str, future: Any, fields: Callable[[Any], dict], scale: str | None = None) -> None:
        error = future.exception()
        if error is None:
            self.update(op, "active" if scale == "scale_out" else "done", **fields(future.result()))
        else:
            self.update(op, "failed", error=f"{type(error).__name__}: {error}")
        if scale:
            self.busy.clear()
            self.idle.set()
            if self.autoscaler is not None:
                self.autoscaler.operation_ended(time.monotonic())
            engines = sorted(self.run.engine_indices)
            what = f"{op} {scale} {'failed: ' + str(error) if error else 'done'}; serving engines {engines}"
            self.notify("scale_failed" if error else "scaled", what)

    # ------------------------------------------------------------------ autoscaler
    def _autoscale(self, snap: dict[str, Any]) -> None:
        cfg = self.run.config
        step_rows = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
        fill = queue_fill(snap["queue"]["rows"] or 0.0, cfg.max_staleness, step_rows)
        serving = sum(not e["draining"] for e in snap["engines"])
        obs = Observation(
            snap["step"],
            serving,
            snap["trainer_idle_frac"] or 0.0,
            fill,
            time.monotonic(),
            self.busy.is_set(),
        )
        decision = self.autoscaler.observe(obs)
        self._record(decision)
        if decision.action is None:
            return
        request = {"num_engines": 1}
        try:
            ray.get(self.hub.submit.remote(decision.action, request, "autoscaler"), timeout=HUB_TIMEOUT_S)
        except Exception as exc:  # e.g. an operator's operation got there first, or nothing is removable
            log.warning("autoscaler: step %d: %s not submitted: %s", decision.step, decision.action, exc)

    def _record(self, decision: Decision) -> None:
        log.info("autoscaler: step %d: %s -- %s", decision.step, decision.action or "hold", decision.reason)
        self.decisions.append({"step": decision.step, "action": decision.action, "reason": decision.reason})
        del self.decisions[:-DECISIONS_KEPT]


class _Done:
    """A finished scale-in as a future-like value for ``_finish``."""

    def __init__(self, results: dict[str, Any], errors: list[str]) -> None:
        self._results, self._errors = results, errors

    def exception(self) -> BaseException | None:
        return RuntimeError("; ".join(self._errors)) if self._errors else None

    def result(self) -> dict[str, Any]:
        return self._results
