"""Colocate mode: rollout and training take turns on the same resources; strictly on-policy."""

from __future__ import annotations

import time

import ray
from tqdm import tqdm

from relax.core.controller import stages
from relax.core.controller.samples import build_groups


def colocate_step(state) -> dict[str, float]:
    """One step: prompts -> generate -> reward -> filter -> logprobs -> advantages -> train -> sync."""
    cfg, roles = state.cfg, state.roles
    metrics: dict[str, float] = {}
    step = state.step + 1
    started = time.perf_counter()

    items = state.dataset.next_batch()
    groups = build_groups(items, step, cfg, state.next_group_id)
    state.next_group_id += len(groups)
    n_requests = sum(len(g) for g in groups)
    with stages.timed(metrics, "generate"), tqdm(
        total=n_requests, desc=f"rollout step {step}", leave=False, disable=not cfg.logging.progress
    ) as bar:
        stages.generate(roles.engines, groups, cfg, step, state.stop_token_ids, on_progress=bar.update)
    samples = [s for g in groups for s in g]
    gen_tokens = sum(len(s.response_ids) for s in samples)
    metrics["perf/rollout_tokens_per_s"] = gen_tokens / max(metrics["time/generate_s"], 1e-9)

    with stages.timed(metrics, "reward"):
        scored, counts = ray.get(roles.reward.score.remote(samples))
    metrics.update({f"reward/{k}": float(v) for k, v in counts.items()})
    metrics.update(stages.sample_metrics(scored))
    by_group: dict[int, list] = {}
    for s in scored:
        by_group.setdefault(s.group_id, []).append(s)
    kept, dropped = stages.filter_groups(list(by_group.values()))
    metrics["groups/dropped"] = float(dropped)
    train_samples = [s for g in kept for s in g]

    if train_samples:
        from relax.core.data import collate

        raw = collate(train_samples, state.pad_id)
        with stages.timed(metrics, "logprob"):
            old_ref = roles.trainer.forward_logprobs.remote(raw)
            ref_ref = roles.reference.forward_logprobs.remote(raw) if roles.reference else None
            old_lp = ray.get(old_ref)
            ref_lp = ray.get(ref_ref) if ref_ref else None
        batch, adv_metrics = stages.prepare_batch(train_samples, state.pad_id, cfg, old_lp, ref_lp)
        metrics.update(adv_metrics)
        with stages.timed(metrics, "train"):
            train_metrics = ray.get(roles.trainer.train_step.remote(batch))
        metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
    state.step = step
    state.version += 1 if train_samples else 0
    if train_samples and state.version % cfg.weight_sync.every_n_steps == 0:
        with stages.timed(metrics, "sync"):
            metrics.update(state.sync_weights())
    elapsed = time.perf_counter() - started
    metrics["time/step_s"] = elapsed
    metrics["perf/tokens_per_s"] = gen_tokens / max(elapsed, 1e-9)
    state.end_step(metrics)
    return metrics
