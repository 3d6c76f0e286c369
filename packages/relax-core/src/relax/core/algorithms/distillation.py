"""On-policy distillation: per-token reverse KL to a teacher, as a loss or folded into RL advantages.

The student samples, the teacher scores the sampled tokens, and each token is pushed by the
sampled reverse KL ``log pi(a) - log pi_T(a)``: Agarwal et al. 2024 (GKD, arXiv:2306.13649, §3,
on-policy GKD with student-sampled data and the reverse-KL divergence); Lu & Thinking Machines
2025 ("On-Policy Distillation", per-token advantage ``-(log pi - log pi_T)``, zero discount).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import masked_mean
from relax.core.algorithms.policy_losses import PolicyLossInputs, agg, approx_kl, log_ratio, weighted


def reverse_kl(logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """Per-token sampled reverse KL ``log pi(a) - log pi_T(a)`` (detached)."""
    return logprobs.detach() - teacher_logprobs.detach()


def add_opd_to_advantages(
    advantages: Tensor, logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float
) -> Tensor:
    """RL + distillation: ``A'_t = A_t - coef * (log pi_t - log pi_T,t)`` on valid tokens (slime's
    OPD mode). Returns a new tensor; ``advantages`` is not modified."""
    shaped = advantages - coef * reverse_kl(logprobs, teacher_logprobs).to(advantages.dtype)
    return torch.where(mask > 0, shaped, advantages)


def opd(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """Distillation alone: ``L = sg(log pi - log pi_T) * r`` with ``r = pi / pi_old``.

    On-policy (``pi_old = pi``) the value is the mean sampled reverse KL and the gradient is
    ``(log pi - log pi_T) grad log pi``, the score-function gradient of the per-token reverse
    KL. ``inputs.advantages`` is ignored. Metric ``opd_reverse_kl``.
    """
    if inputs.teacher_logprobs is None:
        raise ValueError("opd needs inputs.teacher_logprobs")
    rkl = reverse_kl(inputs.logprobs, inputs.teacher_logprobs)
    lr = log_ratio(inputs)
    losses = rkl * torch.exp(lr)
    metrics = {
        "opd_reverse_kl": float(masked_mean(rkl.float(), inputs.response_mask.float()).item()),
        "approx_kl": approx_kl(inputs, lr),
    }
    return agg(inputs, weighted(inputs, losses)), metrics
