"""The torch trainer's optimizer: AdamW, the update with its finite checks, and the learning-rate schedule as a
pure function of the step (so the step counter is the whole state)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.graph import increment_version

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0
) -> float:
    """Multiplier on the base LR for 0-based ``step``.

    Warmup is linear, ``(step + 1) / warmup_steps`` (the first step already learns), reaching 1 at
    ``step = warmup_steps - 1``. After warmup, ``linear`` and ``cosine`` decay from 1 to
    ``min_lr_ratio`` at ``step = total_steps`` and stay there; ``total_steps <= warmup_steps``
    means no decay. ``constant`` stays at 1.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw(params: list[torch.nn.Parameter], device: torch.device, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW, fused on CPU and CUDA as HF Trainer's default (one kernel, not one per tensor). The fused kernel
    writes without bumping the tensors' version counters, which the hosted engine's fingerprint reads
    (``engines.hosted``): a post-step hook bumps them, as an unfused step does."""
    optimizer = torch.optim.AdamW(params, fused=device.type in ("cpu", "cuda"), **kwargs)
    optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    increment_version([p for group in optimizer.param_groups for p in group["params"]])


def apply_update(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grad_clip: float, loss: float
) -> tuple[float, str | None, bool]:
    """Clip the gradients and step, unless the loss or the gradient is not finite: (grad norm, what was not
    finite, whether the step ran). A problem found before the step leaves the weights and zeroes the
    gradients; one after it (the update made a weight non-finite) cannot be undone."""
    max_norm = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} (loss {loss}, grad_norm "
                           f"{grad_norm}); the update was not applied"), False  # fmt: skip
    optimizer.step()
    # float64 L2 norms are non-finite exactly when a weight is (no fp32 value overflows them); 4x faster than
    # the inf-norm on CPU
    if not torch.isfinite(torch.stack(torch._foreach_norm(params, 2, dtype=torch.float64))).all():
        return grad_norm, f"the update (lr {optimizer.param_groups[0]['lr']:g}) made the weights non-finite", True
    return grad_norm, None, True
