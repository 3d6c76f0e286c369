"""Config-level checks of algorithm combinations that cannot work, with errors naming the field.

Called from ``relax.core.config._semantic_errors`` before anything starts. Checks about what a
built-in estimator or loss needs are keyed by its name; names a plugin registers are only checked
for generic constraints (ranges, paths), since only the plugin knows what it needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.core.algorithms.config import POLICY_INIT
from relax.core.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

# estimators comparing responses to the same prompt: a group of 1 has no baseline
GROUP_ESTIMATORS = frozenset(
    {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"}
)
VALUE_ESTIMATORS = frozenset({"gae"})  # need critic values
GREEDY_ESTIMATORS = frozenset({"remax"})  # need the greedy response's reward
KL_ESTIMATORS_NEEDING_REF = frozenset({"reinforce_plus_plus"})  # token-level KL to a reference


def _names(items: frozenset[str]) -> str:
    return ", ".join(repr(n) for n in sorted(items))


def _param_errors(path: str, what: str, fn: Callable[..., Any], params: dict[str, Any]) -> list[str]:
    """Unknown keys in ``*_params`` for a built-in function (plugins declare their own); the same
    rule ``objective._kwargs`` enforces at build time, reported before anything starts."""
    sig = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
        return []
    accepted = list(sig)[1:]
    return [
        f"{path}.{key}: {what} takes no parameter {key!r}; it takes: {', '.join(accepted) or '(none)'}"
        for key in params
        if key not in accepted
    ]


def _critic_errors(cfg: Any) -> list[str]:
    a, c = cfg.algorithm, cfg.algorithm.critic
    errors = []
    if a.advantage_estimator in VALUE_ESTIMATORS and not c.enable:
        errors.append(
            f"algorithm.critic.enable: advantage estimator {a.advantage_estimator!r} needs critic values; "
            "set algorithm.critic.enable=true"
        )
    if (
        c.enable
        and a.advantage_estimator in ADVANTAGE_ESTIMATORS
        and a.advantage_estimator not in VALUE_ESTIMATORS
    ):
        errors.append(
            f"algorithm.critic.enable: advantage estimator {a.advantage_estimator!r} does not use critic values "
            f"(estimators that do: {_names(VALUE_ESTIMATORS)}); set it to false or change the estimator"
        )
    if not c.enable:
        return errors
    for name, value in [("lr", c.lr), ("value_clip", c.value_clip)]:
        if value <= 0:
            errors.append(f"algorithm.critic.{name}: must be > 0, got {value!r}")
    if c.grad_clip < 0:
        errors.append(f"algorithm.critic.grad_clip: must be >= 0, got {c.grad_clip!r}")
    if not 0 <= c.warmup_steps < cfg.total_steps:
        errors.append(
            f"algorithm.critic.warmup_steps: must be in [0, total_steps={cfg.total_steps}) so the policy "
            f"trains at all, got {c.warmup_steps}"
        )
    if c.model_path is not None and not Path(c.model_path).is_dir():
        errors.append(
            f"algorithm.critic.model_path: {c.model_path!r} is not a directory (HF-format model expected)"
        )
    return errors


def _teacher_errors(a: Any) -> list[str]:
    errors = []
    uses_teacher = a.policy_loss == "opd" or a.opd_coef > 0
    if a.opd_coef < 0:
        errors.append(f"algorithm.opd_coef: must be >= 0, got {a.opd_coef!r}")
    if a.policy_loss == "opd" and a.opd_coef > 0:
        errors.append(
            "algorithm.opd_coef: policy_loss 'opd' already is the distillation loss; set opd_coef=0, "
            "or keep opd_coef and use an RL loss such as 'ppo' (RL + distillation)"
        )
    if uses_teacher and not a.teacher_model_path:
        errors.append(
            "algorithm.teacher_model_path: on-policy distillation (policy_loss 'opd' or opd_coef > 0) needs a "
            f"teacher; set an HF model directory or {POLICY_INIT!r} (the policy's initial model)"
        )
    if a.teacher_model_path and not uses_teacher:
        errors.append(
            "algorithm.teacher_model_path: set but unused; only policy_loss 'opd' or algorithm.opd_coef > 0 "
            "read teacher logprobs"
        )
    if a.teacher_model_path not in (None, POLICY_INIT) and not Path(a.teacher_model_path).is_dir():
        errors.append(
            f"algorithm.teacher_model_path: {a.teacher_model_path!r} is neither {POLICY_INIT!r} nor a directory "
            "(HF-format model expected)"
        )
    return errors


def _sampling_errors(cfg: Any) -> list[str]:
    a, n = cfg.algorithm, cfg.rollout.n_samples_per_prompt
    errors = []
    if a.advantage_estimator in GROUP_ESTIMATORS and n < 2:
        errors.append(
            f"rollout.n_samples_per_prompt: advantage estimator {a.advantage_estimator!r} "
            f"compares responses within a group and needs >= 2, got {n}"
        )
    ds = a.dynamic_sampling
    if ds.enable and n < 2:
        errors.append(
            f"algorithm.dynamic_sampling.enable: drops groups whose rewards are all equal, so every group of "
            f"rollout.n_samples_per_prompt={n} would be dropped; needs >= 2"
        )
    if ds.max_extra_rounds < 0:
        errors.append(f"algorithm.dynamic_sampling.max_extra_rounds: must be >= 0, got {ds.max_extra_rounds}")
    ov = a.overlong
    if not 0 <= ov.buffer <= cfg.rollout.max_new_tokens:
        errors.append(
            f"algorithm.overlong.buffer: must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}] "
            f"(0 disables), got {ov.buffer}"
        )
    if ov.penalty_factor < 0:
        errors.append(f"algorithm.overlong.penalty_factor: must be >= 0, got {ov.penalty_factor!r}")
    if a.advantage_estimator in GREEDY_ESTIMATORS and not a.greedy_baseline:
        errors.append(
            f"algorithm.greedy_baseline: advantage estimator {a.advantage_estimator!r} uses the reward of a greedy "
            "response as its baseline; set algorithm.greedy_baseline=true"
        )
    if (
        a.greedy_baseline
        and a.advantage_estimator in ADVANTAGE_ESTIMATORS
        and a.advantage_estimator not in GREEDY_ESTIMATORS
    ):
        errors.append(
            f"algorithm.greedy_baseline: advantage estimator {a.advantage_estimator!r} ignores the greedy baseline "
            f"(estimators that use it: {_names(GREEDY_ESTIMATORS)}); set it to false"
        )
    return errors


def _kl_and_correction_errors(a: Any) -> list[str]:
    errors = []
    if a.advantage_estimator in KL_ESTIMATORS_NEEDING_REF and a.kl.coef <= 0:
        errors.append(
            f"algorithm.kl.coef: advantage estimator {a.advantage_estimator!r} regularises towards a reference "
            "model (REINFORCE++ token-level KL); set algorithm.kl.coef > 0 (kl.use: reward shapes the "
            "token rewards as in the paper, kl.use: loss adds it to the loss)"
        )
    corr = a.correction
    if corr.is_mode != "none" and not 0 <= corr.is_low < corr.is_high:
        errors.append(
            f"algorithm.correction.is_low/is_high: need 0 <= is_low < is_high for is_mode {corr.is_mode!r}, "
            f"got {corr.is_low!r}, {corr.is_high!r}"
        )
    if corr.opsm_delta is not None and corr.opsm_delta < 0:
        errors.append(f"algorithm.correction.opsm_delta: must be >= 0 or null, got {corr.opsm_delta!r}")
    for name, value in [("gamma", a.gamma), ("lam", a.lam)]:
        if not 0 <= value <= 1:
            errors.append(f"algorithm.{name}: must be in [0, 1], got {value!r}")
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        errors.append(f"algorithm.loss_scale_factor: must be > 0 or null, got {a.loss_scale_factor!r}")
    if a.entropy_coef < 0:
        errors.append(f"algorithm.entropy_coef: must be >= 0 (a bonus), got {a.entropy_coef!r}")
    return errors


def algorithm_config_errors(cfg: Any) -> list[str]:
    """Every impossible ``algorithm`` combination in a ``RelaxConfig``, one message per problem."""
    a = cfg.algorithm
    errors = [
        *_sampling_errors(cfg),
        *_critic_errors(cfg),
        *_teacher_errors(a),
        *_kl_and_correction_errors(a),
    ]
    if a.advantage_estimator in ADVANTAGE_ESTIMATORS:
        fn = ADVANTAGE_ESTIMATORS[a.advantage_estimator]
        what = f"advantage estimator {a.advantage_estimator!r}"
        errors += _param_errors("algorithm.advantage_params", what, fn, a.advantage_params)
    if a.policy_loss in POLICY_LOSSES:
        fn = POLICY_LOSSES[a.policy_loss]
        errors += _param_errors("algorithm.loss_params", f"policy loss {a.policy_loss!r}", fn, a.loss_params)
    return errors
