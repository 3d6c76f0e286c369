"""Async and hybrid modes: one training step, top to bottom.

``async``: rollout, reward, reference and advantage roles run concurrently and stream through the
transfer queue (``Pipeline``); the trainer takes ready step batches. ``hybrid``: rollout and reward
stream the same way, while reference/old logprobs and advantages are computed inside the step.
"""

from __future__ import annotations

import time
from collections import Counter

from relax.core.controller import recovery, stages
from relax.core.controller.pipeline import Pipeline, merge_rewards, pad_rows
from relax.core.data import collate


def start_pipeline(state) -> Pipeline:
    return Pipeline(
        state.cfg, prompts=state.prompts, fleet=state.fleet, reward=state.roles.reward,
        reference=state.roles.reference, pad_id=state.pad_id, stop_token_ids=state.stop_token_ids,
        step=state.step, version=state.version,
    )


def pipelined_step(state) -> dict[str, float]:
    cfg, roles = state.cfg, state.roles
    if state.pipeline is None:
        state.pipeline = start_pipeline(state)
    pipe: Pipeline = state.pipeline
    step, started, metrics = state.step + 1, time.perf_counter(), {}

    # 1. the step's rollouts, already scored (and with reference logprobs / advantages in async)
    batch, waited = pipe.take(step)
    samples = merge_rewards(batch)
    metrics.update(pipe.rollout_stats.pop(step, {}))
    metrics.update(stages.sample_metrics(samples))
    metrics.update(staleness_metrics([state.version - s.min_version for s in samples]))
    metrics["rollout/mixed_version_frac"] = sum(s.min_version != s.max_version for s in samples) / len(samples)
    metrics["time/trainer_wait_s"] = waited

    # 2. filter groups (plugins' relax_filter_group), in group order as colocate trains them
    row_of = {id(s): i for i, s in enumerate(samples)}
    kept, dropped = stages.filter_groups(group_in_order(samples))
    metrics["groups/dropped"] = float(dropped)
    train_samples = [s for g in kept for s in g]

    # 3. old logprobs (+ what the queue roles did not compute), advantages, one optimizer step
    if train_samples:
        raw = collate(train_samples, state.pad_id)
        width = raw["responses"].shape[1]
        with stages.timed(metrics, "logprob"):
            fwd = stages.forward_batch(roles, raw, cfg, with_reference=not pipe.use_reference)
        if pipe.use_reference:
            fwd["ref_logprobs"] = pad_rows([batch.data["ref_logprobs"][row_of[id(s)]] for s in train_samples], width)
        adv = pad_rows([batch.data["advantages"][row_of[id(s)]] for s in train_samples], width) if pipe.advantage_role else None
        train_batch, adv_metrics = stages.prepare_batch(
            train_samples, state.pad_id, cfg, fwd["old_logprobs"], fwd.get("ref_logprobs"),
            values=fwd.get("values"), teacher_logprobs=fwd.get("teacher_logprobs"),
            sum_pi_squared=fwd.get("sum_pi_squared"), raw=raw, advantages=adv,
        )
        metrics.update(adv_metrics)
        with stages.timed(metrics, "train"):
            metrics.update({f"train/{k}": float(v) for k, v in recovery.train(state, train_batch, step).items()})
    else:
        recovery.commit_step(state, step, trained=False)
    pipe.queue.ack("trainer", batch.keys)

    # 4. publish the new weights every N steps (opens the staleness gate for the producer)
    if train_samples and state.version % cfg.weight_sync.every_n_steps == 0:
        with stages.timed(metrics, "sync"):
            metrics.update(pipe.publish_weights(state.version))

    # 5. metrics
    queue_metrics = {k: float(v) for k, v in pipe.queue.metrics().items()}
    elapsed = time.perf_counter() - started
    metrics.update(queue_metrics)
    metrics.update(pipe.rates(queue_metrics))
    metrics["time/step_s"] = elapsed
    metrics["perf/trainer_idle_frac"] = waited / max(elapsed, 1e-9)
    metrics.update(state.fleet.metrics())
    state.end_step(metrics)
    return metrics


def group_in_order(samples: list) -> list[list]:
    """Samples regrouped by group id (ascending), each group by index within the group."""
    by_group: dict[int, list] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    return [sorted(g, key=lambda s: s.index_in_group) for _, g in sorted(by_group.items())]


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Mean/max plus a histogram (``staleness/count_<s>``) of per-sample staleness."""
    counts = Counter(staleness)
    out = {f"staleness/count_{s}": float(n) for s, n in sorted(counts.items())}
    out["staleness/mean"] = sum(staleness) / max(len(staleness), 1)
    out["staleness/max"] = float(max(staleness, default=0))
    return out


MODE_LOOPS = {"async": pipelined_step, "hybrid": pipelined_step}
