"""The learning-rate schedule: a pure function of the update's step counter (the counter is the
schedule's whole state, so a checkpoint stores one integer)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(schedule: str) -> None:
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0
) -> float:
    """Multiplier on the base LR for 0-based ``step``.

    Warmup is linear, ``(step + 1) / warmup_steps`` (the first step already learns), reaching 1 at
    ``step = warmup_steps - 1``. After warmup, ``linear`` and ``cosine`` decay from 1 to
    ``min_lr_ratio`` at ``step = total_steps`` and stay there; ``total_steps <= warmup_steps``
    means no decay. ``constant`` stays at 1.
    """
    check_schedule(schedule)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
