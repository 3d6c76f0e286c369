"""Config -> callables: the advantage step and the per-micro-batch policy objective.

The trainer knows nothing about the algorithm: it builds ``objective = build_policy_objective(cfg)``
once and calls ``loss, metrics = objective(inputs)`` per micro-batch, then ``loss.backward()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from relax.core.algorithms.advantages import AdvantageInputs, token_rewards
from relax.core.algorithms.aggregation import masked_mean
from relax.core.algorithms.config import AlgorithmConfig
from relax.core.algorithms.corrections import masked_is, opsm_mask, truncated_is
from relax.core.algorithms.distillation import add_opd_to_advantages, reverse_kl
from relax.core.algorithms.kl import apply_kl_penalty
from relax.core.algorithms.policy_losses import PolicyLossInputs, agg, zero_masked
from relax.core.algorithms.registry import get_advantage_estimator, get_kl_estimator, get_policy_loss

Objective = Callable[[PolicyLossInputs], tuple[Tensor, dict[str, float]]]


def _kwargs(fn: Callable[..., Any], defaults: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Config-level defaults the function declares, overridden by explicit ``params``.

    Unknown explicit params raise ``TypeError`` naming the function, before any tensor work.
    """
    sig = inspect.signature(fn)
    accepted = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = [k for k in params if k not in accepted and not takes_any]
    if unknown:
        raise TypeError(
            f"{getattr(fn, '__name__', fn)!r} does not take parameter(s) {unknown}; it takes {list(accepted)[1:]}"
        )
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    kwargs.update(params)
    return kwargs


def compute_advantages(
    cfg: AlgorithmConfig, inputs: AdvantageInputs, kl_coef: float | None = None
) -> tuple[Tensor, Tensor]:
    """Run ``cfg.advantage_estimator`` with ``cfg.advantage_params``.

    ``norm_adv_by_std``, ``gamma`` and ``lam`` come from the config for estimators that take them.
    With ``cfg.kl.use == "reward"`` and a positive coefficient (``kl_coef`` overrides
    ``cfg.kl.coef``, e.g. from an adaptive controller), the KL penalty is first folded into the
    token rewards (see ``apply_kl_penalty``), so every estimator sees the shaped rewards.
    """
    fn = get_advantage_estimator(cfg.advantage_estimator)
    coef = cfg.kl.coef if kl_coef is None else kl_coef
    if cfg.kl.use == "reward" and coef > 0:
        if inputs.old_logprobs is None or inputs.ref_logprobs is None:
            raise ValueError(
                "algorithm.kl.use='reward' needs old_logprobs and ref_logprobs in AdvantageInputs"
            )
        shaped, _ = apply_kl_penalty(
            token_rewards(inputs),
            inputs.old_logprobs,
            inputs.ref_logprobs,
            inputs.response_mask,
            coef,
            get_kl_estimator(cfg.kl.estimator),
        )
        inputs = replace(inputs, token_level_rewards=shaped, kl_coef=0.0)
    defaults = {"norm_adv_by_std": cfg.norm_adv_by_std, "gamma": cfg.gamma, "lam": cfg.lam}
    return fn(inputs, **_kwargs(fn, defaults, cfg.advantage_params))


def build_policy_objective(cfg: AlgorithmConfig) -> Objective:
    """Combine policy loss + KL-in-loss + entropy bonus + mismatch corrections + distillation.

    ``loss = pg_loss + kl.coef * agg(KL(pi || pi_ref)) - entropy_coef * agg(entropy)``, every
    term aggregated with ``cfg.loss_agg_mode`` (which overrides ``inputs.loss_agg_mode``) and the
    inputs' global counts. Corrections multiply detached weights into the per-token policy loss:
    IS weights compare ``old_logprobs`` (trainer-side, at rollout policy version) with
    ``rollout_logprobs``; OPSM compares the current policy with ``rollout_logprobs`` (or
    ``old_logprobs`` when absent). ``cfg.opd_coef > 0`` folds the teacher's reverse KL into the
    advantages first. Masked positions (padding, observation spans between turns) are zeroed in every
    per-token input first (``zero_masked``), so nothing there reaches the loss or its gradient.

    Metrics ``loss``, ``pg_loss``, ``kl_loss`` and ``entropy`` are this call's share of the
    aggregate when global counts are given (sum them over micro-batches); the rest (fractions,
    ``approx_kl``, mismatch) are means over this micro-batch's valid tokens (average them).
    """
    loss_fn = get_policy_loss(cfg.policy_loss)
    loss_kwargs = _kwargs(
        loss_fn,
        {"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high},
        cfg.loss_params,
    )
    kl_fn = get_kl_estimator(cfg.kl.estimator) if cfg.kl.coef > 0 and cfg.kl.use == "loss" else None
    corr = cfg.correction
    is_fn = {"truncate": truncated_is, "mask": masked_is}.get(corr.is_mode)

    def objective(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
        scale = inputs.loss_scale_factor if cfg.loss_scale_factor is None else cfg.loss_scale_factor
        inputs = zero_masked(replace(inputs, loss_agg_mode=cfg.loss_agg_mode, loss_scale_factor=scale))
        mask = inputs.response_mask
        metrics: dict[str, float] = {}
        if cfg.opd_coef > 0:
            if inputs.teacher_logprobs is None:
                raise ValueError("algorithm.opd_coef > 0 needs teacher_logprobs in PolicyLossInputs")
            rkl = reverse_kl(inputs.logprobs, inputs.teacher_logprobs)
            metrics["opd_reverse_kl"] = float(masked_mean(rkl.float(), mask.float()).item())
            adv = add_opd_to_advantages(
                inputs.advantages, inputs.logprobs, inputs.teacher_logprobs, mask, cfg.opd_coef
            )
            inputs = replace(inputs, advantages=adv)
        weights = inputs.is_weights
        if is_fn is not None:
            if inputs.rollout_logprobs is None:
                raise ValueError(
                    f"algorithm.correction.is_mode={corr.is_mode!r} needs rollout_logprobs in PolicyLossInputs"
                )
            w, m = is_fn(
                inputs.old_logprobs, inputs.rollout_logprobs, mask, corr.is_level, corr.is_low, corr.is_high
            )
            weights = w if weights is None else weights * w
            metrics.update(m)
        if corr.opsm_delta is not None:
            behavior = inputs.rollout_logprobs if inputs.rollout_logprobs is not None else inputs.old_logprobs
            keep, m = opsm_mask(inputs.logprobs, behavior, inputs.advantages, mask, corr.opsm_delta)
            weights = keep if weights is None else weights * keep
            metrics.update({k if k.startswith("opsm_") else f"opsm_{k}": v for k, v in m.items()})
        inputs = replace(inputs, is_weights=weights)

        pg_loss, pg_metrics = loss_fn(inputs, **loss_kwargs)
        metrics.update(pg_metrics)
        metrics["pg_loss"] = float(pg_loss.item())
        loss = pg_loss
        if kl_fn is not None:
            if inputs.ref_logprobs is None:
                raise ValueError(
                    "algorithm.kl.coef > 0 with use='loss' needs ref_logprobs in PolicyLossInputs"
                )
            kl_loss = agg(inputs, kl_fn(inputs.logprobs, inputs.ref_logprobs.detach()))
            loss = loss + cfg.kl.coef * kl_loss
            metrics["kl_loss"] = float(kl_loss.item())
        if cfg.entropy_coef and inputs.entropy is None:
            raise ValueError("algorithm.entropy_coef != 0 needs entropy in PolicyLossInputs")
        if inputs.entropy is not None:
            entropy = agg(inputs, inputs.entropy)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * entropy
            metrics["entropy"] = float(entropy.item())
        metrics["loss"] = float(loss.item())
        return loss, metrics

    return objective
