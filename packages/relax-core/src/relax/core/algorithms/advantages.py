"""Advantage estimators on token sequences: GAE, REINFORCE++, ReMax (group estimators:
``group_advantages``, per-token group baselines: ``token_baselines``).

Uniform signature: ``fn(inputs: AdvantageInputs, **params) -> (advantages (B, T), returns (B, T))``.
Outputs are detached and exactly zero at masked positions; inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import masked_whiten
from relax.core.algorithms.kl import get_builtin_kl


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: Tensor  # (B,) sequence reward
    response_mask: Tensor  # (B, T) float 0/1; 0 = padding or observation token
    index: Tensor  # (B,) long group id (all responses to one prompt); need not be contiguous
    values: Tensor | None = None  # (B, T) critic values (GAE)
    token_level_rewards: Tensor | None = None  # (B, T); None = sequence reward on the last valid token
    old_logprobs: Tensor | None = None  # (B, T) for KL reward shaping
    ref_logprobs: Tensor | None = None  # (B, T)
    kl_coef: float = 0.0  # REINFORCE++ in-estimator KL shaping
    greedy_rewards: Tensor | None = None  # (B,) ReMax baseline: reward of the greedy response
    sum_pi_squared: Tensor | None = None  # (B, T) sum over the vocabulary of pi^2 (optimal token baseline)
    reward_components: dict[str, Tensor] | None = None  # name -> (B,) parts of the reward (GDPO)


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence reward on its last valid token; rows with no valid token get nothing."""
    valid = mask > 0
    t = mask.shape[-1]
    last = t - 1 - torch.flip(valid.to(torch.long), dims=[-1]).argmax(dim=-1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has_any = valid.any(dim=-1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has_any]
    out[rows, last[has_any]] = rewards.detach()[has_any]
    return out


def token_rewards(inputs: AdvantageInputs) -> Tensor:
    """(B, T) per-token rewards, zero at masked positions."""
    mask = inputs.response_mask
    if inputs.token_level_rewards is None:
        return last_token_rewards(as_float(inputs.rewards), mask)
    tr = as_float(inputs.token_level_rewards.detach())
    return torch.where(mask > 0, tr, torch.zeros_like(tr))


def sequence_scores(inputs: AdvantageInputs) -> Tensor:
    """(B,) outcome score: sum of valid token rewards when given, else the sequence reward."""
    if inputs.token_level_rewards is None:
        return as_float(inputs.rewards.detach())
    return token_rewards(inputs).sum(dim=-1)


def as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x))


@torch.no_grad()
def gae(inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438, Eq. 16).

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``, where
    ``t'`` is the next *valid* token: masked (padding or observation) tokens are skipped, so
    values and TD errors never cross them (same recursion as verl). Returns ``A + V`` before
    whitening; advantages are whitened over the batch's valid tokens.
    """
    if inputs.values is None:
        raise ValueError("gae needs inputs.values (critic values)")
    rewards = token_rewards(inputs)
    mask = inputs.response_mask.to(rewards.dtype)
    values = _zero_masked(inputs.values.detach().to(rewards.dtype), mask)
    bsz, t_len = mask.shape
    next_value = torch.zeros(bsz, dtype=rewards.dtype, device=mask.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(t_len)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = torch.where(m > 0, values[:, t], next_value)
        last_gae = torch.where(m > 0, candidate, last_gae)
        adv[:, t] = last_gae
    returns = _zero_masked(adv + values, mask)
    return masked_whiten(adv, mask), returns


@torch.no_grad()
def reinforce_plus_plus(
    inputs: AdvantageInputs, gamma: float = 1.0, kl_estimator: str = "k1"
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, §3: token-level KL penalty, discounted return,
    global advantage normalisation).

    ``r'_t = r_t - kl_coef * KL_t(old || ref)``, ``G_t = sum_{s>=t} gamma^(s-t) r'_s`` over valid
    tokens, ``A = whiten(G)`` over the whole batch. Masked (observation) tokens are skipped: the
    return is carried across them and discounted per generated token, like GAE (and verl's GAE).
    Deliberate deviation: verl's REINFORCE++ resets the return at every masked token, which assumes
    masks only trail (padding) and would cut a multi-turn response's early turns off the outcome reward.
    """
    rewards = token_rewards(inputs)
    mask = inputs.response_mask.to(rewards.dtype)
    if inputs.kl_coef:
        if inputs.old_logprobs is None or inputs.ref_logprobs is None:
            raise ValueError("reinforce_plus_plus with kl_coef > 0 needs old_logprobs and ref_logprobs")
        kl = get_builtin_kl(kl_estimator)(inputs.old_logprobs.detach(), inputs.ref_logprobs.detach())
        rewards = rewards - inputs.kl_coef * _zero_masked(kl.to(rewards.dtype), mask)
    running = torch.zeros(mask.shape[0], dtype=rewards.dtype, device=mask.device)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = _zero_masked(returns, mask)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def remax(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505, Algorithm 1): REINFORCE with the greedy response's
    reward as baseline, ``A_t = sum_{s>=t} r_s - r(greedy)``."""
    if inputs.greedy_rewards is None:
        raise ValueError("remax needs inputs.greedy_rewards (reward of the greedy response per prompt)")
    rewards = token_rewards(inputs)
    mask = inputs.response_mask.to(rewards.dtype)
    returns = torch.flip(torch.cumsum(torch.flip(rewards, dims=[-1]), dim=-1), dims=[-1])
    returns = _zero_masked(returns, mask)
    adv = _zero_masked(returns - inputs.greedy_rewards.detach().to(rewards.dtype).unsqueeze(-1), mask)
    return adv, returns
