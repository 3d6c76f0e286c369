"""Outcome advantage estimators that compare responses to the same prompt (group = ``inputs.index``).

Each returns ``(advantages, advantages)`` broadcast over valid tokens (zero where masked).

Group conventions, matching verl unless noted:

- A **singleton group** has no baseline: its mean is taken as 0 and its std as 1, so GRPO gives
  ``r / (1 + eps)``, RLOO/OPO/Dr.GRPO give ``r`` (verl's ``rloo_vectorized`` gives RLOO
  singletons 0; keeping ``r`` follows the one "no baseline = baseline 0" rule of every estimator
  here). Deliberate deviation: ``grpo_passk`` gives 0 (verl raises), since pass@k needs at least
  two samples to compare and one short group must not stop a run.
- A **zero-variance group** (two or more members, all scores equal) gets advantage exactly 0
  everywhere, instead of the float noise ``(r - mean(r)) / eps`` could produce.
- Standard deviations are unbiased (Bessel-corrected), as ``torch.std`` in verl.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.core.algorithms.advantages import AdvantageInputs, as_float, sequence_scores
from relax.core.algorithms.aggregation import masked_whiten


class _Groups:
    """Per-group statistics of a (B,) score vector, gathered back to (B,)."""

    def __init__(self, scores: Tensor, index: Tensor) -> None:
        self.scores = scores
        _, self.inv = torch.unique(index, return_inverse=True)
        n_groups = int(self.inv.max().item()) + 1 if self.inv.numel() else 0
        self.n_groups = n_groups
        self.size = torch.bincount(self.inv, minlength=n_groups).to(scores.dtype)[self.inv]
        self.multi = self.size > 1

    def sum(self, x: Tensor) -> Tensor:
        return torch.zeros(self.n_groups, dtype=x.dtype, device=x.device).index_add_(0, self.inv, x)[self.inv]

    def reduce(self, x: Tensor, how: str) -> Tensor:
        out = torch.zeros(self.n_groups, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, self.inv, x, reduce=how, include_self=False)[self.inv]

    def mean(self) -> Tensor:
        """Group mean; 0 for singletons."""
        return torch.where(self.multi, self.sum(self.scores) / self.size, torch.zeros_like(self.scores))

    def std(self) -> Tensor:
        """Unbiased group std; 1 for singletons."""
        centered = self.scores - self.sum(self.scores) / self.size
        var = self.sum(centered**2) / (self.size - 1).clamp(min=1)
        return torch.where(self.multi, var.sqrt(), torch.ones_like(self.scores))

    def constant(self) -> Tensor:
        """True for members of multi-member groups whose scores are all equal."""
        return self.multi & (self.reduce(self.scores, "amax") == self.reduce(self.scores, "amin"))


def _broadcast(adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    out = torch.where(
        mask > 0, adv.unsqueeze(-1).expand(mask.shape), torch.zeros((), dtype=adv.dtype, device=adv.device)
    )
    return out, out


def _grpo_scores(scores: Tensor, index: Tensor, epsilon: float, norm_adv_by_std: bool) -> Tensor:
    """(B,) ``(r - mean_G r) / (std_G r + eps)`` (no std division unless ``norm_adv_by_std``)."""
    g = _Groups(scores, index)
    adv = g.scores - g.mean()
    if norm_adv_by_std:
        adv = adv / (g.std() + epsilon)
    return torch.where(g.constant(), torch.zeros_like(adv), adv)


@torch.no_grad()
def grpo(
    inputs: AdvantageInputs, epsilon: float = 1e-6, norm_adv_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, §4.1.2):
    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; without the std division when
    ``norm_adv_by_std`` is False (Dr. GRPO)."""
    adv = _grpo_scores(sequence_scores(inputs), inputs.index, epsilon, norm_adv_by_std)
    return _broadcast(adv, inputs.response_mask)


@torch.no_grad()
def gdpo(
    inputs: AdvantageInputs,
    reward_keys: list[str] | None = None,
    reward_weights: list[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Group reward-Decoupled normalization Policy Optimization (GDPO, NVIDIA 2026, arXiv:2601.05242):
    with several rewards, summing them before GRPO's group normalisation lets one reward drown
    the others, so each component is normalised within its group on its own,
    ``A = whiten_batch(sum_k w_k * grpo(r_k))``, whitened over the batch's valid tokens.

    ``reward_keys`` name entries of ``inputs.reward_components`` (the reward's ``reward_info``);
    then the final reward, and any shaping applied to it, is not used (as verl's
    ``gdpo_reward_keys``). ``None``: the final reward alone (GRPO, then batch whitening).
    ``reward_weights`` default to 1 each (verl's ``gdpo_reward_weights``).
    """
    if reward_keys is None:
        components = [sequence_scores(inputs)]
    else:
        if isinstance(reward_keys, str) or not reward_keys:
            raise ValueError(f"gdpo: reward_keys must be a non-empty list of names, got {reward_keys!r}")
        available = inputs.reward_components or {}
        missing = [k for k in reward_keys if k not in available]
        if missing:
            raise ValueError(
                f"gdpo: reward_keys {missing} are not reward components; available: {sorted(available)}"
            )
        components = [as_float(available[k].detach()) for k in reward_keys]
    weights = [1.0] * len(components) if reward_weights is None else list(reward_weights)
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} reward_weights for {len(components)} reward components")
    total = sum(
        w * _grpo_scores(c, inputs.index, epsilon, norm_adv_by_std)
        for w, c in zip(weights, components, strict=True)
    )
    mask = inputs.response_mask.to(total.dtype)
    out = masked_whiten(total.unsqueeze(-1).expand(mask.shape), mask)
    return out, out


@torch.no_grad()
def dr_grpo(inputs: AdvantageInputs, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantage (Liu et al. 2025, arXiv:2503.20783, §3.2): ``A_i = r_i - mean(r_group)``,
    no std normalisation. Pair it with ``loss_agg_mode="seq-mean-token-sum-norm"`` for the
    paper's length-unbiased loss."""
    return grpo(inputs, epsilon=epsilon, norm_adv_by_std=False)


@torch.no_grad()
def rloo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740, §3.2; Kool et al. 2019):
    ``A_i = r_i - mean_{j != i} r_j = (n r_i - sum_j r_j) / (n - 1)``; singletons keep ``r_i``."""
    g = _Groups(sequence_scores(inputs), inputs.index)
    loo = (g.size * g.scores - g.sum(g.scores)) / (g.size - 1).clamp(min=1)
    adv = torch.where(g.multi, loo, g.scores)
    adv = torch.where(g.constant(), torch.zeros_like(adv), adv)
    return _broadcast(adv, inputs.response_mask)


@torch.no_grad()
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, §3): subtract the group mean reward,
    then whiten over all valid tokens of the batch (global normalisation)."""
    g = _Groups(sequence_scores(inputs), inputs.index)
    adv = torch.where(g.constant(), torch.zeros_like(g.scores), g.scores - g.mean())
    mask = inputs.response_mask.to(adv.dtype)
    out = masked_whiten(adv.unsqueeze(-1).expand(mask.shape), mask)
    return out, out


@torch.no_grad()
def opo(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585, §3.2):
    length-weighted group baseline ``b = sum_j |o_j| r_j / sum_j |o_j|``, ``A_i = r_i - b``."""
    g = _Groups(sequence_scores(inputs), inputs.index)
    lengths = inputs.response_mask.to(g.scores.dtype).sum(dim=-1)
    total = g.sum(lengths)
    weighted = g.sum(lengths * g.scores)
    baseline = torch.where(g.multi & (total > 0), weighted / total.clamp(min=1e-12), torch.zeros_like(total))
    adv = torch.where(g.constant(), torch.zeros_like(g.scores), g.scores - baseline)
    return _broadcast(adv, inputs.response_mask)


@torch.no_grad()
def gpg(inputs: AdvantageInputs, f_norm: float = 1.0) -> tuple[Tensor, Tensor]:
    """Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546, §3.2):
    ``A_i = alpha (r_i - mean(r_group)) / F_norm`` with the batch correction
    ``alpha = B / #{i: r_i != 0}`` (as verl counts it)."""
    g = _Groups(sequence_scores(inputs), inputs.index)
    alpha = g.scores.numel() / max(int(torch.count_nonzero(g.scores).item()), 1)
    adv = alpha * (g.scores - g.mean()) / f_norm
    adv = torch.where(g.constant(), torch.zeros_like(adv), adv)
    return _broadcast(adv, inputs.response_mask)


@torch.no_grad()
def grpo_passk(
    inputs: AdvantageInputs, epsilon: float = 1e-6, norm_adv_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """Pass@k training (Tang et al. 2025, arXiv:2503.19595, as in verl): only the best response of
    each group is credited, ``A_best = (r_max - r_second) / (std(r_group) + eps)``; all others 0."""
    g = _Groups(sequence_scores(inputs), inputs.index)
    gmax = g.reduce(g.scores, "amax")
    pos = torch.arange(g.scores.numel(), device=g.scores.device)
    at_max = g.scores == gmax
    big = torch.full_like(pos, g.scores.numel())
    first = g.reduce(torch.where(at_max, pos, big), "amin")
    is_best = at_max & (pos == first) & g.multi
    others = torch.where(is_best, torch.full_like(g.scores, float("-inf")), g.scores)
    second = g.reduce(others, "amax")
    gap = torch.where(is_best, gmax - second, torch.zeros_like(g.scores))
    if norm_adv_by_std:
        gap = gap / (g.std() + epsilon)
    return _broadcast(gap, inputs.response_mask)
