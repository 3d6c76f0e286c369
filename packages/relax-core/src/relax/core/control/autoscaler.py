"""Autoscaler policy: pure decisions from per-step observations (the agent acts on them).

Scale out by one engine when rollout is the bottleneck -- over the last ``steps`` steps the
trainer idled above ``idle_frac`` of the time on average while the queue was starved (below
``starved_fill`` on average of what the staleness gate lets the producer run ahead). Scale in by
one when the queue stayed at least ``full_fill`` full on average (the trainer is the bottleneck).
Averages over a window, because with ``max_staleness >= 1`` steps alternate between waiting for
rollout and finding the next batch already there.
Bounds ``min_engines`` / ``max_engines``; no decision within ``cooldown_s`` of the end of the last
scale operation, nor while one is in flight. Every decision says why.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relax.core.control.settings import AutoscalerConfig


@dataclass(frozen=True)
class Observation:
    step: int
    engines: int  # serving, not draining
    trainer_idle_frac: float
    queue_fill: float  # rows waiting / rows the producer may run ahead (0..1)
    now: float  # monotonic seconds
    busy: bool = False  # a scale operation is in flight


@dataclass(frozen=True)
class Decision:
    step: int
    action: str | None  # "scale_out", "scale_in" or None
    reason: str


def queue_fill(rows: float, max_staleness: int, step_rows: int) -> float:
    """Rows in the queue over the most the producer may have generated ahead of the trainer."""
    return min(1.0, rows / max(1, (max_staleness + 1) * step_rows))


class Autoscaler:
    def __init__(self, cfg: AutoscalerConfig) -> None:
        self.cfg = cfg
        self.window: deque[Observation] = deque(maxlen=cfg.steps)
        self.quiet_until = float("-inf")  # cool-down end (monotonic)

    def operation_ended(self, now: float) -> None:
        """A scale operation (ours or an operator's) finished: start the cool-down, reset streaks."""
        self.quiet_until = now + self.cfg.cooldown_s
        self.window.clear()

    def observe(self, obs: Observation) -> Decision:
        c, window = self.cfg, self.window
        window.append(obs)
        idle = sum(o.trainer_idle_frac for o in window) / len(window)
        fill = sum(o.queue_fill for o in window) / len(window)
        complete = len(window) == c.steps
        starved = complete and idle > c.idle_frac and fill < c.starved_fill
        full = complete and fill >= c.full_fill
        seen = (
            f"over {len(window)}/{c.steps} steps trainer idle {idle:.0%}, queue {fill:.0%} full; "
            f"{obs.engines} engine(s)"
        )

        def hold(why: str) -> Decision:
            return Decision(obs.step, None, f"{why} ({seen})")

        if obs.busy:
            return hold("a scale operation is in flight")
        if obs.now < self.quiet_until:
            return hold(f"cooling down for {self.quiet_until - obs.now:.0f}s more")
        if starved:
            if obs.engines >= c.max_engines:
                return hold(f"rollout is the bottleneck but max_engines={c.max_engines} is reached")
            window.clear()
            return Decision(obs.step, "scale_out", f"rollout is the bottleneck: {seen}")
        if full:
            if obs.engines <= c.min_engines:
                return hold(f"the queue stays full but min_engines={c.min_engines} is reached")
            window.clear()
            return Decision(obs.step, "scale_in", f"the queue stays full: {seen}")
        return hold("no change")
