"""Policy losses that replace PPO's ratio clip with another trust region: DPPO, M2PO, Clip-Cov, KL-Cov.

Same signature and conventions as ``policy_losses`` (see its module docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import masked_mean
from relax.core.algorithms.policy_losses import (
    PolicyLossInputs,
    agg,
    approx_kl,
    clip_metrics,
    frac,
    log_ratio,
    weighted,
)


def _dppo(
    inputs: PolicyLossInputs, valid: Tensor, lr: Tensor, clip_ratio_c: float
) -> tuple[Tensor, dict[str, float]]:
    """Shared DPPO surrogate: ``L = -A * sg(min(r, c)) * log pi`` on tokens inside the trust region."""
    adv = inputs.advantages.detach()
    ratio = torch.exp(lr)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = valid.detach().to(inputs.logprobs.dtype)
    losses = -adv * truncated * inputs.logprobs * valid
    outside = valid == 0
    metrics = {
        "clip_frac": frac(inputs, outside),
        "clip_frac_high": frac(inputs, outside & (adv > 0)),
        "clip_frac_low": frac(inputs, outside & (adv <= 0)),
        "truncated_frac": frac(inputs, (ratio.detach() > clip_ratio_c) & ~outside),
        "approx_kl": approx_kl(inputs, lr),
    }
    return agg(inputs, weighted(inputs, losses)), metrics


def dppo_tv(
    inputs: PolicyLossInputs,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv:2602.04879, Eq. 13).

    A token stays in the trust region unless the update moves its probability the way the
    advantage pushes it by more than a TV budget: ``pi - pi_old <= delta_high`` for A > 0,
    ``pi - pi_old >= -delta_low`` otherwise. Here ``clip_ratio_low/high`` are those probability
    budgets, not ratio bounds (as verl's ``dppo_tv``). Kept tokens use the truncated-IS policy
    gradient with weight ``min(r, clip_ratio_c)`` (paper §5.4, verl default 20).
    """
    lr = log_ratio(inputs)
    diff = torch.exp(inputs.logprobs) - torch.exp(inputs.old_logprobs.detach())
    adv = inputs.advantages.detach()
    valid = torch.where(adv > 0, diff <= clip_ratio_high, diff >= -clip_ratio_low)
    return _dppo(inputs, valid, lr, clip_ratio_c)


def dppo_binary_kl(
    inputs: PolicyLossInputs,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879, Eq. 14; verl calls it ``dppo_kl``).

    The divergence is the KL between the Bernoulli distributions (pi_old(a), 1 - pi_old(a)) and
    (pi(a), 1 - pi(a)); a token leaves the trust region when that KL exceeds ``clip_ratio_high``
    while its probability rises with A > 0, or ``clip_ratio_low`` while it falls with A <= 0.
    """
    lr = log_ratio(inputs)
    old_lp = inputs.old_logprobs.detach()
    p, p_old = torch.exp(inputs.logprobs.detach()), torch.exp(old_lp)
    binary_kl = p_old * (old_lp - inputs.logprobs.detach()) + (1 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )
    adv = inputs.advantages.detach()
    valid = torch.where(
        adv > 0, (binary_kl <= clip_ratio_high) | (p <= p_old), (binary_kl <= clip_ratio_low) | (p >= p_old)
    )
    return _dppo(inputs, valid, lr, clip_ratio_c)


def m2po_mask(
    log_r: Tensor, adv: Tensor, mask: Tensor, m2_threshold: float
) -> tuple[Tensor, dict[str, float]]:
    """M2PO Algorithm 1: among trust-region tokens (A > 0 and r > 1, or A < 0 and r < 1), drop the
    largest ``(log r)^2`` until their mean is <= ``m2_threshold``. Returns a 0/1 keep mask."""
    m2 = log_r.detach().square()
    valid = mask > 0
    trust = valid & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    keep = torch.ones_like(m2)
    values = m2[trust]
    before = float(values.mean().item()) if values.numel() else 0.0
    after = before
    if values.numel() and before > m2_threshold:
        ordered, order = torch.sort(values)
        prefix_mean = torch.cumsum(ordered, 0) / torch.arange(
            1, values.numel() + 1, dtype=ordered.dtype, device=ordered.device
        )
        n_keep = int((prefix_mean <= m2_threshold).sum().item())
        flat_keep = keep[trust]
        flat_keep[order[n_keep:]] = 0.0
        keep = keep.masked_scatter(trust, flat_keep)
        after = float(ordered[:n_keep].mean().item()) if n_keep else 0.0
    return keep, {"m2_before": before, "m2_after": after}


def m2po(inputs: PolicyLossInputs, m2_threshold: float = 0.04) -> tuple[Tensor, dict[str, float]]:
    """Second-Moment Trust Policy Optimization (Zheng et al. 2025, arXiv:2510.01161, Eq. 5 and
    Algorithm 1): ``L = -M * r * A`` with ``r = pi / pi_old`` unclipped and ``M`` the
    second-moment mask (:func:`m2po_mask`). Masked tokens stay in the denominator (paper footnote 2).

    The mask is a batch statistic: computed per call, so it is exact when the objective is
    evaluated on the whole mini-batch and an approximation per micro-batch.
    """
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs)
    keep, metrics = m2po_mask(lr.detach(), adv, inputs.response_mask, m2_threshold)
    losses = -adv * torch.exp(lr) * keep
    metrics["m2po_mask_frac"] = frac(inputs, keep == 0)
    metrics["approx_kl"] = approx_kl(inputs, lr)
    return agg(inputs, weighted(inputs, losses)), metrics


def _token_cov(inputs: PolicyLossInputs) -> Tensor:
    """Centered covariance term ``(A - mean A)(log pi - mean log pi)`` over valid tokens (detached)."""
    mask = inputs.response_mask.to(inputs.logprobs.dtype)
    adv, lp = inputs.advantages.detach(), inputs.logprobs.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def clip_cov(
    inputs: PolicyLossInputs,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617,
    §5): PPO clipped loss, plus a random ``clip_cov_ratio`` share of the valid, not-yet-clipped
    tokens whose covariance lies in ``(lb, ub)`` get their gradient detached (loss zeroed).
    Metrics: PPO's ``clip_frac*`` and ``clip_cov_frac``, the detached share (verl's ``pg_clipfrac``).

    Deliberate deviation: the random pick uses a local generator seeded by ``seed`` (verl draws
    from the global RNG), so the function is deterministic.
    """
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs, clamp=False)
    ratio = torch.exp(lr)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    valid = inputs.response_mask > 0
    cov = _token_cov(inputs)
    candidates = valid & ~(loss2.detach() > loss1.detach()) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    cand_idx = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
    n_clip = max(int(clip_cov_ratio * int(valid.sum().item())), 1)
    gen = torch.Generator().manual_seed(seed)
    picked = cand_idx[torch.randperm(cand_idx.numel(), generator=gen)[:n_clip].to(cand_idx.device)]
    corr = torch.ones(adv.numel(), dtype=ratio.dtype, device=ratio.device)
    corr[picked] = 0.0
    corr = corr.view_as(adv)
    losses = torch.maximum(loss1, loss2) * corr
    metrics = clip_metrics(inputs, ratio, adv, clip_ratio_low, clip_ratio_high)
    metrics["clip_cov_frac"] = frac(inputs, corr == 0)
    metrics["approx_kl"] = approx_kl(inputs, lr)
    return agg(inputs, weighted(inputs, losses)), metrics


def kl_cov(
    inputs: PolicyLossInputs, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1
) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, §5): unclipped ``-r A``, plus a KL penalty
    ``ppo_kl_coef * |log r|`` on the top ``kl_cov_ratio`` share of valid tokens by covariance."""
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs, clamp=False)
    loss_pg = -adv * torch.exp(lr)
    valid = (inputs.response_mask > 0).reshape(-1)
    n_valid = int(valid.sum().item())
    selected = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
    if n_valid:
        valid_idx = torch.nonzero(valid).squeeze(-1)
        k = max(1, int(n_valid * kl_cov_ratio))
        top = torch.topk(_token_cov(inputs).reshape(-1)[valid_idx], k).indices
        selected[valid_idx[top]] = True
    selected = selected.view_as(adv)
    losses = torch.where(selected, loss_pg + ppo_kl_coef * lr.abs(), loss_pg)
    mask = inputs.response_mask.float()
    metrics = {
        "kl_cov_frac": frac(inputs, selected),
        "abs_kl": float(masked_mean(lr.detach().abs().float(), mask).item()),
        "approx_kl": approx_kl(inputs, lr),
    }
    return agg(inputs, weighted(inputs, losses)), metrics
