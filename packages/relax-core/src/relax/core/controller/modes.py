"""Async and hybrid modes: the trainer's side of the pipeline, one training step per call.

``async``: rollout, reward, reference and advantage roles run concurrently and stream through the
transfer queue; the trainer takes ready step batches. ``hybrid``: rollout and reward stream the
same way, while reference/old logprobs and advantages are computed inside the training step.
"""

from __future__ import annotations

import time
from collections import Counter

from relax.core.controller import recovery, stages
from relax.core.controller.pipeline import Pipeline, merge_rewards, pad_rows
from relax.core.data import collate


def pipelined_step(state) -> dict[str, float]:
    cfg, roles = state.cfg, state.roles
    if state.pipeline is None:
        state.pipeline = Pipeline(state)
    pipe: Pipeline = state.pipeline
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    batch, waited = pipe.take()
    step = state.step + 1
    samples = merge_rewards(batch)
    metrics.update(pipe.rollout_stats.pop(step, {}))
    metrics.update(stages.sample_metrics(samples))
    metrics.update(staleness_metrics([state.version - s.min_version for s in samples]))
    metrics["rollout/mixed_version_frac"] = sum(s.min_version != s.max_version for s in samples) / len(samples)
    metrics["time/trainer_wait_s"] = waited

    by_group: dict[int, list] = {}
    row_of = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id, []).append(s)
        row_of[id(s)] = i
    kept, dropped = stages.filter_groups([sorted(g, key=lambda s: s.index_in_group) for _, g in sorted(by_group.items())])
    metrics["groups/dropped"] = float(dropped)
    train_samples = [s for g in kept for s in g]  # group order, as colocate trains them
    if train_samples:
        raw = collate(train_samples, state.pad_id)
        width = raw["responses"].shape[1]
        with stages.timed(metrics, "logprob"):
            fwd = stages.forward_batch(roles, raw, cfg, with_reference=not pipe.use_reference)
        if pipe.use_reference:  # computed by the reference role while the batch waited in the queue
            fwd["ref_logprobs"] = pad_rows([batch.data["ref_logprobs"][row_of[id(s)]] for s in train_samples], width)
        adv = None
        if pipe.advantage_role:  # already computed by the advantage role
            adv = pad_rows([batch.data["advantages"][row_of[id(s)]] for s in train_samples], width)
        train_batch, adv_metrics = stages.prepare_batch(
            train_samples, state.pad_id, cfg, fwd["old_logprobs"], fwd.get("ref_logprobs"),
            values=fwd.get("values"), teacher_logprobs=fwd.get("teacher_logprobs"), raw=raw, advantages=adv,
        )
        metrics.update(adv_metrics)
        with stages.timed(metrics, "train"):
            metrics.update({f"train/{k}": float(v) for k, v in recovery.train(state, train_batch, step).items()})
    else:
        recovery.commit_step(state, step, trained=False)
    pipe.queue.ack("trainer", batch.keys)
    if train_samples and state.version % cfg.weight_sync.every_n_steps == 0:
        with stages.timed(metrics, "sync"):
            metrics.update(pipe.publish_weights())
    queue_metrics = {k: float(v) for k, v in pipe.queue.metrics().items()}
    elapsed = time.perf_counter() - started
    metrics.update(queue_metrics)
    metrics.update(pipe.rates(queue_metrics))
    metrics["time/step_s"] = elapsed
    metrics["perf/trainer_idle_frac"] = waited / max(elapsed, 1e-9)
    metrics.update(state.fleet.metrics())
    state.end_step(metrics)
    return metrics


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Mean/max plus a histogram (``staleness/count_<s>``) of per-sample staleness."""
    counts = Counter(staleness)
    out = {f"staleness/count_{s}": float(n) for s, n in sorted(counts.items())}
    out["staleness/mean"] = sum(staleness) / max(len(staleness), 1)
    out["staleness/max"] = float(max(staleness, default=0))
    return out


MODE_LOOPS = {"async": pipelined_step, "hybrid": pipelined_step}
