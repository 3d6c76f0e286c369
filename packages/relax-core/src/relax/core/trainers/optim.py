"""The torch trainer's optimizer: fused AdamW, gradient clipping and a step that checks the weights after it
(the LR schedule and the non-finite policy are the loop's: ``relax.core.policy_update``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version


def adamw(params: list[torch.nn.Parameter], device: torch.device, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW, fused on CPU and CUDA as HF Trainer's default (one kernel, not one per tensor). The fused kernel
    writes without bumping the tensors' version counters, which the hosted engine's fingerprint reads
    (``engines.hosted``): a post-step hook bumps them, as an unfused step does."""
    optimizer = torch.optim.AdamW(params, fused=device.type in ("cpu", "cuda"), **kwargs)
    optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    increment_version([p for group in optimizer.param_groups for p in group["params"]])


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients to ``max_norm`` (``inf``: no clip); the total norm before clipping."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def step_checked(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> str | None:
    """Step, then check the weights: None, or what went wrong (an update that made a weight non-finite
    cannot be undone)."""
    optimizer.step()
    # float64 L2 norms are non-finite exactly when a weight is (no fp32 value overflows them); 4x faster than
    # the inf-norm on CPU
    if not torch.isfinite(torch.stack(torch._foreach_norm(params, 2, dtype=torch.float64))).all():
        return f"the update (lr {optimizer.param_groups[0]['lr']:g}) made the weights non-finite"
    return None
