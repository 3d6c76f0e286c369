"""KL estimators, entropy, KL controllers and the KL reward penalty.

Estimators follow Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html)
with ``log r = ref_logprob - logprob`` for samples drawn from the policy:
k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. Signature: ``fn(logprobs, ref_logprobs) -> (B, T)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import masked_mean

KLFn = Callable[[Tensor, Tensor], Tensor]


def k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref: unbiased KL(pi || pi_ref) value, high variance (Schulman 2020)."""
    return logprobs - ref_logprobs


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|log pi - log pi_ref| (verl's ``abs``)."""
    return (logprobs - ref_logprobs).abs()


def k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2: biased value, but its gradient is the KL gradient (Schulman 2020)."""
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = r - 1 - log r with r = pi_ref / pi: unbiased, non-negative, low variance (Schulman 2020).

    Clamped as verl's ``low_var_kl``: log r to [-20, 20] and the result to [-10, 10].
    """
    log_r = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)


def straight_through(estimator: KLFn) -> KLFn:
    """``estimator+``: forward value of ``estimator``, gradient of k2.

    k1 and k3 estimate the KL value without bias but not its gradient; k2's gradient is the
    right one, so the "+" variants keep the value and take k2's gradient (verl ``kl_penalty``).
    """

    def plus(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        grad_part = k2(logprobs, ref_logprobs)
        return grad_part - grad_part.detach() + estimator(logprobs, ref_logprobs).detach()

    plus.__name__ = f"{estimator.__name__}_plus"
    plus.__doc__ = f"Straight-through {estimator.__name__}: value of {estimator.__name__}, gradient of k2."
    return plus


KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": k1,
    "kl": k1,
    "abs": kl_abs,
    "k2": k2,
    "mse": k2,
    "k3": k3,
    "low_var_kl": k3,
}
# k2's own gradient is the KL gradient, so ``k2+`` / ``mse+`` are k2 itself (verl accepts both names)
KL_ESTIMATORS.update(
    {f"{name}+": fn if fn is k2 else straight_through(fn) for name, fn in list(KL_ESTIMATORS.items())}
)


def get_builtin_kl(name: str) -> KLFn:
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; built-in: {sorted(KL_ESTIMATORS)}") from None


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[token]`` over the last dim, in fp32 and in logsumexp form (no (..., V)
    log-softmax copy): the per-token logprobs every loss here consumes."""
    logits = logits.float()
    return logits.gather(-1, tokens[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)


def logprobs_and_sum_pi_squared(logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """``logprobs_from_logits`` and, sharing its logsumexp, the per-position ``sum_v pi(v)^2`` (the
    optimal token baselines' gradient-norm term), both fp32. ``sum_v exp(2 (z_v - lse))`` needs one
    extra (..., V) tensor, built and exponentiated in place; it equals verl's ``exp(lse(2z) - 2 lse(z))``
    (``calculate_sum_pi_squared_from_logits``), which needs a second logsumexp over ``2z``."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1)
    logprobs = logits.gather(-1, tokens[..., None]).squeeze(-1) - lse
    return logprobs, (logits - lse[..., None]).mul_(2.0).exp_().sum(dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy ``H = logsumexp(z) - sum softmax(z) z`` over the last dim
    (Shannon 1948, Theorem 2: ``H = -sum p log p``)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@dataclass(frozen=True)
class KLController:
    """State of the KL coefficient controller (Ziegler et al. 2019, arXiv:1909.08593, §2.2).

    ``fixed`` keeps ``value``; ``adaptive`` steers the measured KL toward ``target_kl``.
    """

    value: float
    kind: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000


def update_kl_controller(ctrl: KLController, current_kl: float, n_steps: int) -> KLController:
    """Next controller state: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon``
    (Ziegler et al. 2019, §2.2, proportional controller)."""
    if ctrl.kind == "fixed":
        return ctrl
    if ctrl.horizon <= 0 or ctrl.target_kl <= 0:
        raise ValueError("adaptive KL controller needs horizon > 0 and target_kl > 0")
    error = min(max(current_kl / ctrl.target_kl - 1.0, -0.2), 0.2)
    return replace(ctrl, value=ctrl.value * (1.0 + error * n_steps / ctrl.horizon))


def apply_kl_penalty(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    estimator: str | KLFn = "k1",
) -> tuple[Tensor, dict[str, float]]:
    """KL as a reward penalty: ``r_t - coef * KL_t`` on valid tokens (Ziegler et al. 2019, §2.2;
    Ouyang et al. 2022, arXiv:2203.02155, Eq. 2).

    Returns the new rewards and ``{"reward_kl": mean over sequences of the per-sequence mean KL,
    "reward_kl_coef": coef}``; feed ``reward_kl`` to :func:`update_kl_controller`. Fully masked
    rows are left out of the KL mean (verl counts them as 0).
    """
    fn = get_builtin_kl(estimator) if isinstance(estimator, str) else estimator
    kl = fn(logprobs.detach(), ref_logprobs.detach())
    kl = torch.where(mask > 0, kl, torch.zeros_like(kl))
    rewards = token_rewards - coef * kl.to(token_rewards.dtype)
    seq_kl = masked_mean(kl, mask.to(kl.dtype), dim=-1)
    nonempty = (mask > 0).any(dim=-1).to(kl.dtype)
    current = masked_mean(seq_kl, nonempty)
    return rewards, {"reward_kl": float(current.item()), "reward_kl_coef": float(coef)}
