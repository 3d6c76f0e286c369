"""Algorithm config (the ``algorithm:`` section). Names are checked against the algorithm registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class KLConfig:
    coef: float = 0.0  # 0 disables the reference model entirely
    estimator: str = "k3"  # registered kind="kl" name
    use: Literal["loss", "reward"] = "loss"  # as a loss term or as a reward penalty


@dataclass(frozen=True)
class CorrectionConfig:
    """Rollout/train mismatch corrections; the IS modes need per-token rollout logprobs."""

    is_mode: Literal["none", "truncate", "mask"] = "none"  # truncate = TIS, mask = IcePop-style masked IS
    is_level: Literal["token", "sequence", "geometric"] = "token"
    is_low: float = 0.0  # lower bound on the IS ratio (truncate: clamp, mask: drop below)
    is_high: float = 2.0  # upper bound on the IS ratio (truncate: clamp, mask: drop above)
    opsm_delta: float | None = None  # off-policy sequence masking threshold; None disables it


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage_estimator: str = "grpo"  # registered kind="advantage" name
    policy_loss: str = "ppo"  # registered kind="policy_loss" name
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    norm_adv_by_std: bool = True
    entropy_coef: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    # extra keyword arguments for the chosen estimator / loss (plugins define their own)
    advantage_params: dict[str, Any] = field(default_factory=dict)
    loss_params: dict[str, Any] = field(default_factory=dict)
    gamma: float = 1.0  # discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor; None = padded length T
    opd_coef: float = 0.0  # on-policy distillation: advantage -= opd_coef * (logp - teacher_logp)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
