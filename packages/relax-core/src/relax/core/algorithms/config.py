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
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose ``metric`` is equal for every member (no gradient)
    and draw extra prompt batches until the step has ``rollout.prompts_per_step`` groups."""

    enable: bool = False
    metric: str = "score"  # reward_info key compared within a group; "reward" = final (shaped) reward
    max_extra_rounds: int = 4  # extra prompt batches per step at most; 0 = only filter


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO soft overlong punishment over the last ``buffer`` tokens before ``rollout.max_new_tokens``."""

    buffer: int = 0  # L_cache; 0 disables
    penalty_factor: float = 1.0


@dataclass(frozen=True)
class CriticConfig:
    """PPO critic: HF backbone + scalar value head, trained with the clipped value loss."""

    enable: bool = False
    model_path: str | None = None  # None = the policy's initial model
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    value_clip: float = 0.5  # clip range of V around the rollout-time values
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    warmup_steps: int = 0  # the first N train steps update only the critic


POLICY_INIT = "policy_init"  # teacher_model_path value meaning "the policy's initial model"


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
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    greedy_baseline: bool = False  # one extra greedy response per prompt, scored (ReMax baseline)
    # distillation teacher (policy_loss "opd" or opd_coef > 0): an HF directory or "policy_init"
    teacher_model_path: str | None = None
    # MoE routing replay (R3, docs/moe.md): the trainer's forwards use the experts the rollout engine chose;
    # "rollout": the policy's forwards; "reference": the reference model's forwards as well
    routing_replay: Literal["off", "rollout", "reference"] = "off"
