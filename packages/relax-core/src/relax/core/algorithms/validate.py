"""Config-level checks of algorithm combinations that cannot work, with errors naming the field.

Called from ``relax.core.config._semantic_errors`` before anything starts. What an estimator or
loss needs comes from what it declared at registration (``needs`` / ``modes``, see
``relax.core.algorithm_needs``), so a plugin's algorithm is checked exactly like a built-in one;
no rule here names an algorithm. Unknown names are reported by the config loader and get only
the generic range checks here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.core.algorithm_needs import NEEDS, UNPROVIDED, AlgorithmSpec
from relax.core.algorithms.config import POLICY_INIT
from relax.core.algorithms.registry import algorithm_spec, algorithm_specs

_FIELD = {"advantage": "algorithm.advantage_estimator", "policy_loss": "algorithm.policy_loss"}


def _param_errors(path: str, what: str, fn: Callable[..., Any], params: dict[str, Any]) -> list[str]:
    """Unknown keys in ``*_params`` (the rule ``objective._kwargs`` enforces at build time, reported
    before anything starts); a function taking ``**kwargs`` accepts any key."""
    sig = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
        return []
    accepted = list(sig)[1:]
    return [
        f"{path}.{key}: {what} takes no parameter {key!r}; it takes: {', '.join(accepted) or '(none)'}"
        for key in params
        if key not in accepted
    ]


def _chosen(a: Any) -> tuple[AlgorithmSpec | None, AlgorithmSpec | None]:
    """The configured estimator and loss, None for a name nobody registered."""

    def spec(kind: str, name: str) -> AlgorithmSpec | None:
        try:
            return algorithm_spec(kind, name)
        except KeyError:
            return None

    return spec("advantage", a.advantage_estimator), spec("policy_loss", a.policy_loss)


def _those_that(need: str) -> str:
    return ", ".join(repr(s.name) for kind in _FIELD for s in algorithm_specs(kind) if need in s.needs)


class _Users:
    """Which of the chosen algorithms declare each need; ``known`` is False when a name is
    unregistered (then nothing can be said about an unused setting)."""

    def __init__(self, estimator: AlgorithmSpec | None, loss: AlgorithmSpec | None) -> None:
        self.specs = [s for s in (estimator, loss) if s is not None]
        self.known = len(self.specs) == 2

    def __call__(self, need: str) -> str:
        """'advantage estimator 'x' and policy loss 'y'' for the users of ``need``, '' for none."""
        return " and ".join(s.label for s in self.specs if need in s.needs)

    def unused(self, need: str) -> bool:
        return self.known and not self(need)


def _critic_errors(cfg: Any, users: _Users) -> list[str]:
    a, c = cfg.algorithm, cfg.algorithm.critic
    errors = []
    if users("values") and not c.enable:
        errors.append(
            f"algorithm.critic.enable: {users('values')} needs critic values; set algorithm.critic.enable=true"
        )
    if c.enable and users.unused("values"):
        errors.append(
            f"algorithm.critic.enable: advantage estimator {a.advantage_estimator!r} does not use critic values "
            f"(estimators that do: {_those_that('values')}); set it to false or change the estimator"
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


def _teacher_errors(a: Any, users: _Users) -> list[str]:
    errors = []
    readers = users("teacher")
    if a.opd_coef < 0:
        errors.append(f"algorithm.opd_coef: must be >= 0, got {a.opd_coef!r}")
    if readers and a.opd_coef > 0:
        errors.append(
            f"algorithm.opd_coef: {readers} already reads teacher logprobs (distillation); set opd_coef=0, "
            "or keep opd_coef and use an RL loss such as 'ppo' (RL + distillation)"
        )
    who = readers or ("algorithm.opd_coef > 0" if a.opd_coef > 0 else "")
    if who and not a.teacher_model_path:
        errors.append(
            f"algorithm.teacher_model_path: {who} needs a distillation teacher; set an HF model "
            f"directory or {POLICY_INIT!r} (the policy's initial model)"
        )
    if a.teacher_model_path and not who and users.known:
        errors.append(
            "algorithm.teacher_model_path: set but unused; no chosen algorithm reads teacher logprobs "
            f"(those that do: {_those_that('teacher')}) and algorithm.opd_coef is 0"
        )
    if a.teacher_model_path not in (None, POLICY_INIT) and not Path(a.teacher_model_path).is_dir():
        errors.append(
            f"algorithm.teacher_model_path: {a.teacher_model_path!r} is neither {POLICY_INIT!r} nor a directory "
            "(HF-format model expected)"
        )
    return errors


def _sampling_errors(cfg: Any, users: _Users) -> list[str]:
    a, n = cfg.algorithm, cfg.rollout.n_samples_per_prompt
    errors = []
    if users("groups") and n < 2:
        errors.append(
            f"rollout.n_samples_per_prompt: {users('groups')} compares responses within a group and needs "
            f">= 2, got {n}"
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
    if users("greedy_baseline") and not a.greedy_baseline:
        errors.append(
            f"algorithm.greedy_baseline: {users('greedy_baseline')} uses the reward of a greedy response "
            "as its baseline; set algorithm.greedy_baseline=true"
        )
    if a.greedy_baseline and users.unused("greedy_baseline"):
        errors.append(
            f"algorithm.greedy_baseline: advantage estimator {a.advantage_estimator!r} ignores the greedy baseline "
            f"(estimators that use it: {_those_that('greedy_baseline')}); set it to false"
        )
    return errors


def _declaration_errors(cfg: Any, users: _Users) -> list[str]:
    """Needs only a config switch satisfies, needs nothing provides yet, and unsupported modes."""
    a, errors = cfg.algorithm, []
    if users("kl") and a.kl.coef <= 0:
        errors.append(
            f"algorithm.kl.coef: {users('kl')} regularises towards a reference model; set "
            "algorithm.kl.coef > 0 (kl.use: reward shapes the token rewards, kl.use: loss adds it to the loss)"
        )
    for spec in users.specs:
        for need in sorted(spec.needs & UNPROVIDED):
            errors.append(
                f"{_FIELD[spec.kind]}: {spec.label} needs {NEEDS[need]}; no role provides it in a run, so it "
                "can only be called from Python (relax.core.algorithms)"
            )
        if cfg.mode not in spec.modes:
            errors.append(
                f"mode: {spec.label} supports mode {', '.join(sorted(spec.modes))} only, got {cfg.mode!r}"
            )
    return errors


def _range_errors(a: Any) -> list[str]:
    errors = []
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
    estimator, loss = _chosen(a)
    users = _Users(estimator, loss)
    errors = [
        *_sampling_errors(cfg, users),
        *_critic_errors(cfg, users),
        *_teacher_errors(a, users),
        *_declaration_errors(cfg, users),
        *_range_errors(a),
    ]
    if estimator is not None:
        params = a.advantage_params
        errors += _param_errors("algorithm.advantage_params", estimator.label, estimator.fn, params)
    if loss is not None:
        errors += _param_errors("algorithm.loss_params", loss.label, loss.fn, a.loss_params)
    return errors
