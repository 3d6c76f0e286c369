"""Policy-gradient losses: PPO family, GSPO, SAPO, CISPO, GMPO, GPG, REINFORCE, DRO.

Uniform signature: ``fn(inputs: PolicyLossInputs, **params) -> (loss scalar, metrics dict[str, float])``.
The loss is differentiable w.r.t. ``inputs.logprobs`` only; old/rollout/reference logprobs and
advantages are treated as constants. ``inputs.is_weights`` (detached per-token weights from
``corrections``) multiply the per-token loss before aggregation; the denominator is unchanged.
Metric names are the same in every loss (means over the micro-batch's valid tokens; docs/algorithms.md
maps each to verl's name): ``approx_kl`` = mean(log pi_old - log pi); where a ratio bound exists,
``clip_frac_high`` / ``clip_frac_low`` = share of tokens where the upper / lower bound binds and
``clip_frac`` = their sum; ``dual_clip_frac`` = share where PPO's dual clip binds.
Masked positions (padding; in multi-turn responses, observation spans between turns) never matter:
reductions read unmasked entries only, ``log_ratio`` is 0 there, and the objective zeroes every
per-token input there first (``zero_masked``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import aggregate_loss, masked_mean, masked_sum, safe_div

LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios to +-20 before exp for stability


@dataclass(frozen=True)
class PolicyLossInputs:
    logprobs: Tensor  # (B, T) current policy, requires grad
    old_logprobs: Tensor  # (B, T) policy that the PPO ratio is taken against
    advantages: Tensor  # (B, T)
    response_mask: Tensor  # (B, T) float 0/1
    rollout_logprobs: Tensor | None = None  # (B, T) from the rollout engine
    ref_logprobs: Tensor | None = None  # (B, T) reference model
    teacher_logprobs: Tensor | None = None  # (B, T) distillation teacher
    entropy: Tensor | None = None  # (B, T) per-token entropy of the current policy (with grad)
    loss_agg_mode: str = "token-mean"
    global_token_count: float | None = None  # step-batch totals, for micro-batch accumulation
    global_seq_count: float | None = None
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor
    is_weights: Tensor | None = None  # (B, T) detached correction weights


#: the per-token fields of ``PolicyLossInputs`` (everything shaped like ``response_mask``)
TOKEN_FIELDS = (
    "logprobs",
    "old_logprobs",
    "advantages",
    "rollout_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "entropy",
    "is_weights",
)


def zero_masked(inputs: PolicyLossInputs) -> PolicyLossInputs:
    """``inputs`` with every per-token tensor 0 where ``response_mask`` is 0 (gradients still flow to
    ``logprobs`` / ``entropy`` at unmasked positions, exactly as before).

    Losses aggregate unmasked tokens only, but a NaN or inf at a masked position (padding, or an
    observation span between turns, whose logprobs and advantages are whatever their producer wrote)
    would still reach the gradient as ``0 * inf`` in backward. Unmasked values are untouched, so
    results are bit-identical for well-formed inputs."""
    valid = inputs.response_mask > 0
    changes = {}
    for name in TOKEN_FIELDS:
        x = getattr(inputs, name)
        if x is not None:
            changes[name] = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return replace(inputs, **changes)


def agg(inputs: PolicyLossInputs, values: Tensor, mode: str | None = None) -> Tensor:
    """Aggregate a per-token loss with the inputs' mode and global counts."""
    return aggregate_loss(
        values,
        inputs.response_mask,
        mode or inputs.loss_agg_mode,
        global_token_count=inputs.global_token_count,
        global_seq_count=inputs.global_seq_count,
        loss_scale_factor=inputs.loss_scale_factor,
    )


def weighted(inputs: PolicyLossInputs, losses: Tensor) -> Tensor:
    return losses if inputs.is_weights is None else losses * inputs.is_weights.detach()


def log_ratio(inputs: PolicyLossInputs, clamp: bool = True) -> Tensor:
    """``log pi - log pi_old``, 0 at masked positions: an unclamped ratio must not overflow on a
    masked token's arbitrary logprobs (``exp`` of it would make ``0 * inf`` gradients there)."""
    lr = inputs.logprobs - inputs.old_logprobs.detach()
    lr = torch.where(inputs.response_mask > 0, lr, torch.zeros((), dtype=lr.dtype, device=lr.device))
    return torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else lr


def frac(inputs: PolicyLossInputs, condition: Tensor) -> float:
    mask = inputs.response_mask.float()
    return float(masked_mean(condition.float(), mask).item())


def approx_kl(inputs: PolicyLossInputs, lr: Tensor) -> float:
    return float(masked_mean(-lr.detach().float(), inputs.response_mask.float()).item())


def clip_metrics(
    inputs: PolicyLossInputs, ratio: Tensor, adv: Tensor, low: float, high: float
) -> dict[str, float]:
    r = ratio.detach()
    clip_high = frac(inputs, (adv > 0) & (r > 1 + high))
    clip_low = frac(inputs, (adv < 0) & (r < 1 - low))
    return {"clip_frac": clip_high + clip_low, "clip_frac_high": clip_high, "clip_frac_low": clip_low}


def ppo(
    inputs: PolicyLossInputs,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, Eq. 7) with decoupled
    clip-higher bounds ``[1 - eps_low, 1 + eps_high]`` (DAPO, arXiv:2503.14476, §3.1) and dual clip
    for negative advantages (Ye et al. 2020, arXiv:1912.09729, §3.2):

    ``L = -min(r A, clip(r) A)``; for ``A < 0``: ``L = min(-min(r A, clip(r) A), -c A)``.
    Extra metric ``dual_clip_frac``: tokens where the dual clip (ratio > c, A < 0) is active.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"ppo: clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs)
    ratio = torch.exp(lr)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_ratio_c
    losses = torch.where(adv < 0, torch.minimum(loss3, clipped), clipped)
    metrics = clip_metrics(inputs, ratio, adv, clip_ratio_low, clip_ratio_high)
    metrics["dual_clip_frac"] = frac(inputs, (clipped.detach() > loss3) & (adv < 0))
    metrics["approx_kl"] = approx_kl(inputs, lr)
    return agg(inputs, weighted(inputs, losses)), metrics


def gspo(
    inputs: PolicyLossInputs, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4
) -> tuple[Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071, §4: GSPO and its
    GSPO-token variant): length-normalised sequence ratio ``s_i = exp(mean_t log r_it)`` used per token as
    ``s_it = sg[s_i] * pi_t / sg[pi_t]`` inside the PPO clip. Aggregated ``seq-mean-token-mean``
    whatever ``loss_agg_mode`` says (as verl). The paper's bounds are 3e-4 / 4e-4.
    """
    adv = inputs.advantages.detach()
    mask = inputs.response_mask.to(inputs.logprobs.dtype)
    lr = log_ratio(inputs, clamp=False)
    seq_lr = safe_div(masked_sum(lr.detach(), mask, dim=-1), mask.sum(dim=-1))
    log_s = inputs.logprobs - inputs.logprobs.detach() + seq_lr.unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = -adv * s
    loss2 = -adv * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(loss1, loss2)
    metrics = clip_metrics(inputs, s, adv, clip_ratio_low, clip_ratio_high)
    metrics["approx_kl"] = approx_kl(inputs, lr)
    return agg(inputs, weighted(inputs, losses), mode="seq-mean-token-mean"), metrics


def sapo(
    inputs: PolicyLossInputs, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> tuple[Tensor, dict[str, float]]:
    """Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347, §3): the hard clip is
    replaced by the smooth gate ``f(r) = (4 / tau) * sigmoid(tau (r - 1))`` (gradient 1 at r = 1),
    ``tau = tau_pos`` if A > 0 else ``tau_neg``; ``L = -f(r) A``. Aggregated ``seq-mean-token-mean``
    (as verl)."""
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs)
    ratio = torch.exp(lr)
    tau = torch.where(
        adv > 0,
        torch.as_tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    losses = -gate * adv
    return agg(inputs, weighted(inputs, losses), mode="seq-mean-token-mean"), {
        "approx_kl": approx_kl(inputs, lr)
    }


def cispo(
    inputs: PolicyLossInputs, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2
) -> tuple[Tensor, dict[str, float]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, §3.1):
    ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi``. The weight is clipped and detached,
    so every token keeps a gradient (unlike PPO, which drops clipped tokens)."""
    adv = inputs.advantages.detach()
    lr = log_ratio(inputs)
    ratio = torch.exp(lr)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    losses = -weight * adv * inputs.logprobs
    r = ratio.detach()
    high, low = frac(inputs, r > 1 + clip_ratio_high), frac(inputs, r < 1 - clip_ratio_low)
    metrics = {"clip_frac": high + low, "clip_frac_high": high, "clip_frac_low": low}
    metrics["approx_kl"] = approx_kl(inputs, lr)
    return agg(inputs, weighted(inputs, losses)), metrics


def gpg(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """Group Policy Gradient loss (Chu et al. 2025, arXiv:2504.02546, §3.2): plain
    ``L = -A log pi`` with no ratio or clipping; pair with the ``gpg`` advantage."""
    losses = -inputs.advantages.detach() * inputs.logprobs
    return agg(inputs, weighted(inputs, losses)), {"approx_kl": approx_kl(inputs, log_ratio(inputs))}


def reinforce(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992, Machine Learning 8:229, the REINFORCE
    score-function update): ``L = -w A log pi`` with
    optional correction weights ``w`` (verl's ``compute_policy_loss_reinforce``, bypass mode)."""
    losses = -inputs.advantages.detach() * inputs.logprobs
    return agg(inputs, weighted(inputs, losses)), {"approx_kl": approx_kl(inputs, log_ratio(inputs))}


def dro(inputs: PolicyLossInputs, dro_beta: float = 0.05) -> tuple[Tensor, dict[str, float]]:
    """Direct Reward Optimization (Richemond et al. 2024, "Offline Regularised RL for LLM
    Alignment", arXiv:2405.19107; per token, as Kimi k1.5's policy objective, arXiv:2501.12599):
    ``L = -(A log pi - (beta / 2) (log pi - log pi_old)^2)``. Instead of clipping, a quadratic
    penalty on the log ratio keeps the update near the sampling policy, so it stays usable
    off-policy (verl ``dro``, ``dro_beta``). The penalty applies to every valid token, whatever
    its advantage. Metric ``dro_penalty``: mean of the quadratic term."""
    if dro_beta < 0:
        raise ValueError(f"dro: dro_beta (penalty weight) must be >= 0, got {dro_beta}")
    lr = inputs.logprobs - inputs.old_logprobs.detach()
    penalty = 0.5 * dro_beta * lr.square()
    losses = -(inputs.advantages.detach() * inputs.logprobs - penalty)
    metrics = {
        "dro_penalty": float(masked_mean(penalty.detach().float(), inputs.response_mask.float()).item()),
        "approx_kl": approx_kl(inputs, lr),
    }
    return agg(inputs, weighted(inputs, losses)), metrics


def gmpo(
    inputs: PolicyLossInputs, clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4
) -> tuple[Tensor, dict[str, float]]:
    """Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673, §3; verl's
    ``geo_mean``): the sequence ratio is the geometric mean of token ratios, each log-ratio
    clipped to ``[-eps_low, eps_high]`` in the pessimistic direction of ``sign(A)``:
    ``L_i = -mean_t(A) * exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r)))``.

    The loss is a mean over sequences (``loss_agg_mode`` is ignored). Deliberate deviation from
    verl: fully masked rows are excluded and ``global_seq_count`` is honoured. The paper's bounds
    are 0.4 / 0.4 in log space.
    """
    adv = inputs.advantages.detach()
    mask = inputs.response_mask.to(inputs.logprobs.dtype)
    lr = log_ratio(inputs, clamp=False)
    sgn = torch.sign(adv)
    lr_clamped = torch.clamp(lr, -clip_ratio_low, clip_ratio_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clamped)
    lengths = mask.sum(dim=-1)
    seq_ratio = torch.exp(safe_div(masked_sum(lr_min, mask, dim=-1), lengths))
    seq_adv = safe_div(masked_sum(adv, mask, dim=-1), lengths)
    losses = -seq_adv * seq_ratio
    if inputs.is_weights is not None:
        log_w = torch.log(inputs.is_weights.detach() + 1e-10)
        losses = losses * torch.exp(safe_div(masked_sum(log_w, mask, dim=-1), lengths))
    nonempty = lengths > 0
    count = nonempty.sum().to(losses.dtype) if inputs.global_seq_count is None else inputs.global_seq_count
    loss = safe_div(torch.where(nonempty, losses, torch.zeros_like(losses)).sum(), count)
    clipped = lr.detach() != lr_clamped.detach()
    metrics = {
        "clip_frac_high": frac(inputs, clipped & (adv > 0)),
        "clip_frac_low": frac(inputs, clipped & (adv < 0)),
        "approx_kl": approx_kl(inputs, lr),
    }
    metrics["clip_frac"] = metrics["clip_frac_high"] + metrics["clip_frac_low"]
    return loss, metrics
