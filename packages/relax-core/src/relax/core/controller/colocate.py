"""Colocate mode: rollout and training take turns on the same resources; strictly on-policy."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from relax.core.controller import local, recovery, stages
from relax.core.controller.handoff import Handoff
from relax.core.data import Sample, collate

if TYPE_CHECKING:
    from relax.core.controller.step import StepContext


def collect_groups(
    state: StepContext, step: int, metrics: dict[str, float]
) -> tuple[list[Sample], list[list[Sample]]]:
    """Roll out, score and filter prompt batches until the step has ``rollout.prompts_per_step``
    groups to train on (DAPO dynamic sampling draws up to ``max_extra_rounds`` extra batches).

    Returns every scored sample (for rollout metrics) and the groups kept for training.
    """
    cfg, roles = state.cfg, state.roles
    ds = cfg.algorithm.dynamic_sampling
    target = cfg.rollout.prompts_per_step
    scored_all: list[Sample] = []
    kept: list[list[Sample]] = []
    dropped_hook = dropped_uniform = extra_rounds = 0
    while True:
        groups, counts = _score_round(state, step, metrics)
        for key, value in counts.items():
            metrics[f"reward/{key}"] = metrics.get(f"reward/{key}", 0.0) + float(value)
        if cfg.algorithm.greedy_baseline:
            with stages.timed(metrics, "greedy_baseline"):
                stages.greedy_baseline(
                    state.fleet.router, roles.reward, groups, cfg, step, state.stop_token_ids
                )
        scored_all += [s for g in groups for s in g]
        round_kept, dropped = stages.filter_groups(groups)
        dropped_hook += dropped
        if ds.enable:
            round_kept, dropped = stages.drop_uniform_groups(round_kept, ds.metric)
            dropped_uniform += dropped
        kept += round_kept
        if not ds.enable or len(kept) >= target or extra_rounds >= ds.max_extra_rounds:
            break
        extra_rounds += 1
    metrics["groups/dropped"] = float(dropped_hook)
    if ds.enable:
        metrics["groups/dropped_uniform"] = float(dropped_uniform)
        metrics["groups/extra_rounds"] = float(extra_rounds)
        metrics["groups/shortfall"] = float(max(0, target - len(kept)))
        kept = kept[:target]
    metrics["groups/kept"] = float(len(kept))
    return scored_all, kept


def _score_round(
    state: StepContext, step: int, metrics: dict[str, float]
) -> tuple[list[list[Sample]], dict[str, float]]:
    """One prompt batch: generate, then score; the reward actor returns scored copies, regrouped here."""
    cfg, roles = state.cfg, state.roles
    groups = state.prompts.draw(step)
    n_requests = sum(len(g) for g in groups)
    with (
        stages.timed(metrics, "generate"),
        tqdm(
            total=n_requests, desc=f"rollout step {step}", leave=False, disable=not cfg.logging.progress
        ) as bar,
    ):
        stages.generate(
            state.fleet.router,
            groups,
            cfg,
            step,
            state.stop_token_ids,
            on_progress=bar.update,
            turns=state.turns,
        )
    with stages.timed(metrics, "reward"):
        scored, counts = stages.score(roles.reward, [s for g in groups for s in g], cfg)
    by_group: dict[int, list[Sample]] = {}
    for s in scored:
        by_group.setdefault(s.group_id, []).append(s)
    return list(by_group.values()), counts


def _fuses_old_logprobs(state: StepContext) -> bool:
    """:func:`stages.fuse_old_logprobs` for this run, asked of the trainer once (colocate is
    strictly on-policy: the engines sampled with the weights the trainer holds)."""
    if state.fused_old_logprobs is None:  # a declared flag (capabilities.DECLARED), not probed by calling it
        offered = local.get(state.roles.trainer.capabilities.remote(), timeout=state.cfg.trainer.timeout_s)
        state.fused_old_logprobs = stages.fuse_old_logprobs(
            state.cfg, state.roles, "fuses_old_logprobs" in offered
        )
    return state.fused_old_logprobs


def _train(state: StepContext, step: int, train_samples: list[Sample], metrics: dict[str, float]) -> None:
    """Old logprobs (unless fused into the update) -> advantages -> the trainer's update."""
    cfg, roles = state.cfg, state.roles
    raw = collate(train_samples, state.pad_id)
    fused = _fuses_old_logprobs(state)
    if fused and stages.engine_scored_old_logprobs(cfg, train_samples, state.version):
        raw["rollout_logprobs_exact"] = torch.ones(len(train_samples), dtype=torch.bool)
    with stages.timed(metrics, "logprob"):
        extra = stages.forward_batch(roles, raw, cfg, old_logprobs=not fused)
    old_lp, ref_lp = extra.pop("old_logprobs", None), extra.pop("ref_logprobs", None)
    batch, adv_metrics = stages.prepare_batch(
        train_samples, state.pad_id, cfg, old_lp, ref_lp, raw=raw, **extra
    )
    metrics.update(adv_metrics)
    if (
        state.sample_log is not None
    ):  # logging.log_samples: what the model wrote, with its reward and advantage
        state.sample_log.record(step, train_samples, batch["advantages"], batch["response_mask"])
    with stages.timed(metrics, "train"):
        train_metrics = recovery.train(state, batch, step)
    for key in ("logprob_abs_diff", "k3_kl"):  # the trainer scored the old logprobs: its mismatch
        if f"rollout_{key}" in train_metrics:
            metrics[f"rollout/train_{key}"] = float(train_metrics.pop(f"rollout_{key}"))
    metrics.update(stages.train_metrics(train_metrics))


def colocate_step(state: StepContext) -> dict[str, float]:
    """One step: prompts -> generate -> reward -> filter -> logprobs -> advantages -> train -> sync, with the
    accelerator handed between engines and trainer around the training (``controller.handoff``)."""
    cfg = state.cfg
    metrics: dict[str, float] = {}
    step = state.step + 1
    started = time.perf_counter()
    handoff = Handoff(state, metrics)
    handoff.before_rollout()  # trainer.offload

    samples, kept = collect_groups(state, step, metrics)
    gen_tokens = sum(len(s.response_ids) for s in samples)
    metrics["perf/rollout_tokens_per_s"] = gen_tokens / max(metrics["time/generate_s"], 1e-9)
    metrics.update(stages.sample_metrics(samples))
    state.failures.record(
        step, samples
    )  # reasons to the console and failures.jsonl; most failed: the run stops
    train_samples = [s for g in kept for s in g]

    with handoff.training():  # engines release, trainer onload ... trainer release, engines resume
        if train_samples:
            _train(state, step, train_samples, metrics)
        else:
            recovery.commit_step(state, step, trained=False)
    if train_samples and state.version % cfg.weight_sync.every_n_steps == 0:
        with stages.timed(metrics, "sync"):
            metrics.update(state.fleet.sync(state.version))
        handoff.mark("sync")
    handoff.after_sync()  # trainer.offload
    elapsed = time.perf_counter() - started
    metrics["time/step_s"] = elapsed
    metrics["perf/tokens_per_s"] = gen_tokens / max(elapsed, 1e-9)
    metrics.update(state.fleet.metrics())
    state.end_step(metrics)
    return metrics
