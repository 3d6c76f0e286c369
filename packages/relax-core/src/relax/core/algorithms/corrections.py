"""Rollout/train mismatch corrections: truncated IS, masked IS (IcePop), off-policy sequence masking.

The rollout engine and the trainer compute slightly different probabilities for the same tokens
(kernels, precision, batch shapes), and async rollouts are stale. Each function returns a
detached (B, T) weight or keep-mask (zero at masked positions) to multiply into the per-token
policy loss (``PolicyLossInputs.is_weights``), plus metrics:
``mismatch_abs_logprob_diff`` = mean |log pi_train - log pi_rollout| and ``mismatch_k3_kl`` = k3
estimate of KL(pi_rollout || pi_train) = mean(r - 1 - log r), r = pi_train / pi_rollout.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import masked_mean, masked_sum, safe_div

Level = Literal["token", "sequence", "geometric"]
SAFETY_BOUND = 20.0  # log-space clamp before exp (verl's rollout_corr_helper)


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    mask = mask.float()
    diff = torch.clamp(
        (train_logprobs.detach() - rollout_logprobs.detach()).float(), -SAFETY_BOUND, SAFETY_BOUND
    )
    return {
        "mismatch_abs_logprob_diff": float(masked_mean(diff.abs(), mask).item()),
        "mismatch_k3_kl": float(masked_mean(torch.exp(diff) - diff - 1.0, mask).item()),
    }


def level_log_ratio(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: Level) -> Tensor:
    """(B, T) log IS ratio: per token, per sequence (sum, i.e. product of ratios) broadcast, or the
    geometric mean per sequence (mean log ratio) broadcast; clamped to +-20."""
    diff = train_logprobs.detach() - rollout_logprobs.detach()
    mask = mask.to(diff.dtype)
    if level == "token":
        out = diff
    elif level == "sequence":
        out = masked_sum(diff, mask, dim=-1).unsqueeze(-1).expand_as(diff)
    elif level == "geometric":
        out = safe_div(masked_sum(diff, mask, dim=-1), mask.sum(dim=-1)).unsqueeze(-1).expand_as(diff)
    else:
        raise ValueError(f"unknown IS level {level!r}; allowed: token, sequence, geometric")
    return torch.clamp(out, -SAFETY_BOUND, SAFETY_BOUND)


def _valid_frac(condition: Tensor, mask: Tensor) -> float:
    return float(masked_mean(condition.float(), mask.float()).item())


def truncated_is(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    level: Level = "token",
    low: float = 0.0,
    high: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training", TIS: ``min(pi_train / pi_rollout, C)`` weight on the policy
    gradient): ``w = clamp(pi_train / pi_rollout, low, high)`` at the chosen level. verl's
    ``rollout_is`` with ``rollout_is_threshold = high``. Metric ``is_clip_frac``."""
    w = torch.exp(level_log_ratio(train_logprobs, rollout_logprobs, mask, level))
    clamped = torch.clamp(w, min=low, max=high)
    weights = torch.where(mask > 0, clamped, torch.zeros_like(clamped))
    metrics = mismatch_metrics(train_logprobs, rollout_logprobs, mask)
    metrics["is_clip_frac"] = _valid_frac(clamped != w, mask)
    metrics["is_weight_mean"] = float(masked_mean(weights.float(), mask.float()).item())
    return weights, metrics


def masked_is(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    level: Level = "token",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """Masked importance sampling, IcePop (Ling Team 2025, arXiv:2510.18855, §IcePop:
    ``M(k) = k if alpha <= k <= beta else 0``, defaults alpha = 0.5, beta = 5): the IS weight is
    kept where the ratio is inside ``[low, high]`` and the token (or, at sequence levels, the whole
    sequence) is dropped otherwise. Metric ``is_mask_frac``."""
    w = torch.exp(level_log_ratio(train_logprobs, rollout_logprobs, mask, level))
    inside = (w >= low) & (w <= high)
    weights = torch.where((mask > 0) & inside, w, torch.zeros_like(w))
    metrics = mismatch_metrics(train_logprobs, rollout_logprobs, mask)
    metrics["is_mask_frac"] = _valid_frac(~inside, mask)
    metrics["is_weight_mean"] = float(masked_mean(weights.float(), mask.float()).item())
    return weights, metrics


def opsm_mask(
    logprobs: Tensor, behavior_logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> tuple[Tensor, dict[str, float]]:
    """Off-policy sequence masking (DeepSeek-AI 2025, DeepSeek-V3.2, arXiv:2512.02556, §3.1):
    drop tokens with negative advantage in sequences whose mean ``log pi_behavior - log pi`` (a
    sampled KL(pi_behavior || pi)) exceeds ``delta``; keep everything else. Checked per token, so
    with sequence-level advantages the whole sequence is dropped (as slime). Metric
    ``opsm_mask_frac``."""
    diff = (behavior_logprobs.detach() - logprobs.detach()).float()
    seq_kl = safe_div(masked_sum(diff, mask.float(), dim=-1), mask.float().sum(dim=-1))
    drop = (advantages.detach() < 0) & (seq_kl > delta).unsqueeze(-1)
    keep = torch.where((mask > 0) & ~drop, 1.0, 0.0).to(logprobs.dtype)
    metrics = mismatch_metrics(logprobs, behavior_logprobs, mask)
    metrics["opsm_mask_frac"] = _valid_frac(drop, mask)
    return keep, metrics
