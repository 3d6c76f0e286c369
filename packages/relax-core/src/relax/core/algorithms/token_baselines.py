"""Optimal token baselines: a per-token, per-group baseline weighted by the policy-gradient norm.

The variance-minimising baseline of a score-function estimator weights returns by the squared
norm of the gradient they multiply, ``b* = E[G ||grad log pi||^2] / E[||grad log pi||^2]``
(Greensmith, Bartlett & Baxter 2004, JMLR 5, "Variance Reduction Techniques for Gradient
Estimates in RL", §3.3). With respect to the logits of a softmax, ``||grad log pi(a)||^2 =
1 - 2 pi(a) + sum_v pi(v)^2``; summing it over the tokens so far gives the path weight
``W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_j(v)^2)`` and the baseline
``B_t = sum_{i in G} G_it W_it / (sum_{i in G} W_it + eps)`` over the group's responses, with
``G_t`` the reward-to-go (verl's ``optimal_token_baseline``).

Same signature and conventions as ``advantages`` (zero at masked positions, inputs unchanged).
Needs ``old_logprobs`` (``pi_j`` of the sampled token) and ``sum_pi_squared`` (``sum_v pi_j(v)^2``).
verl's optional rescaling of ``W`` by squared rollout IS weights is not offered.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.core.algorithms.advantages import AdvantageInputs, token_rewards


def _path_weights(inputs: AdvantageInputs, mask: Tensor) -> Tensor:
    """(B, T) cumulative ``W_t`` over valid tokens (masked tokens add nothing)."""
    if inputs.old_logprobs is None or inputs.sum_pi_squared is None:
        raise ValueError("optimal token baselines need inputs.old_logprobs and inputs.sum_pi_squared")
    pi = torch.exp(inputs.old_logprobs.detach().to(mask.dtype))
    w = 1.0 - 2.0 * pi + inputs.sum_pi_squared.detach().to(mask.dtype)
    return torch.where(mask > 0, w, torch.zeros_like(w)).cumsum(dim=-1)


def _group_baseline(
    returns: Tensor, weights: Tensor, mask: Tensor, index: Tensor, member: Tensor, zero_tail: bool, eps: float
) -> Tensor:
    """(B, T) ``sum_i G W / (sum_i W + eps)`` per group and position, 0 for rows of groups with fewer
    than two ``member`` rows. ``zero_tail``: the one longest response of a group gets baseline 0 from
    the second-longest length on (no other response says anything about those positions)."""
    _, inv = torch.unique(index, return_inverse=True)
    n = int(inv.max().item()) + 1 if inv.numel() else 0

    def group_sum(x: Tensor) -> Tensor:
        return torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, inv, x)[inv]

    def group_max(x: Tensor) -> Tensor:
        out = torch.zeros(n, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, inv, x, reduce="amax", include_self=False)[inv]

    w = torch.where(mask > 0, weights, torch.zeros_like(weights))
    baseline = group_sum(returns * w) / (group_sum(w) + eps)
    multi = member & (group_sum(member.to(returns.dtype)) > 1)
    baseline = torch.where(multi.unsqueeze(-1), baseline, torch.zeros_like(baseline))
    if zero_tail:
        lengths = mask.to(returns.dtype).sum(dim=-1)
        longest = group_max(lengths)
        at_max = lengths == longest
        second = group_max(torch.where(at_max, torch.full_like(lengths, -1.0), lengths))
        unique_longest = multi & at_max & (group_sum(at_max.to(returns.dtype)) == 1) & (longest > second)
        pos = torch.arange(mask.shape[-1], device=mask.device, dtype=returns.dtype)
        tail = unique_longest.unsqueeze(-1) & (pos.unsqueeze(0) >= second.unsqueeze(-1))
        baseline = torch.where(tail, torch.zeros_like(baseline), baseline)
    return baseline


def _reward_to_go(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    rewards = token_rewards(inputs)
    returns = torch.flip(torch.cumsum(torch.flip(rewards, dims=[-1]), dim=-1), dims=[-1])
    return returns, inputs.response_mask.to(rewards.dtype)


@torch.no_grad()
def optimal_token_baseline(
    inputs: AdvantageInputs, handle_zero_tail: bool = True, epsilon: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline (verl's ``optimal_token_baseline``): ``A_t = G_t - B_t`` with the
    module's ``B_t`` taken per absolute position ``t``. A singleton group has baseline 0
    (``A = G``); an all-masked row still counts as a member of its group (as verl)."""
    returns, mask = _reward_to_go(inputs)
    weights = _path_weights(inputs, mask)
    member = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    baseline = _group_baseline(returns, weights, mask, inputs.index, member, handle_zero_tail, epsilon)
    zero = torch.zeros_like(returns)
    return torch.where(mask > 0, returns - baseline, zero), torch.where(mask > 0, returns, zero)


@torch.no_grad()
def tir_optimal_token_baseline(
    inputs: AdvantageInputs, handle_zero_tail: bool = True, epsilon: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Optimal token baseline for tool-integrated (multi-turn) responses (verl's
    ``tir_optimal_token_baseline``): positions are counted in generated tokens only, so the
    k-th generated token of every response shares a baseline whatever observation tokens came
    before it. All-masked rows are not group members."""
    returns, mask = _reward_to_go(inputs)
    weights = _path_weights(inputs, mask)
    valid = mask > 0
    t_len = mask.shape[-1]
    k = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)  # generated-token index of each valid position
    slot = torch.where(valid, k, torch.full_like(k, t_len))  # masked positions go to a spare column

    def compact(x: Tensor) -> Tensor:
        out = torch.zeros((*x.shape[:-1], t_len + 1), dtype=x.dtype, device=x.device)
        return out.scatter(-1, slot, x)[..., :t_len]

    lengths = valid.sum(dim=-1, keepdim=True)
    compact_mask = (torch.arange(t_len, device=mask.device) < lengths).to(mask.dtype)
    member = lengths.squeeze(-1) > 0
    baseline = _group_baseline(
        compact(returns), compact(weights), compact_mask, inputs.index, member, handle_zero_tail, epsilon
    )
    zero = torch.zeros_like(returns)
    adv = torch.where(valid, returns - baseline.gather(-1, k), zero)
    return adv, torch.where(valid, returns, zero)
