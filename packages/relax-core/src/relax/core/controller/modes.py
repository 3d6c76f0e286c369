"""Async and hybrid modes: one training step, top to bottom.

``async``: rollout, reward, reference and advantage roles run concurrently and stream through the
transfer queue (``Pipeline``); the trainer takes ready step batches. ``hybrid``: rollout and reward
stream the same way, while reference/old logprobs and advantages are computed inside the step.
Where each role runs (actors, the trainer's process, the driver) was decided at start-up; the step
only calls them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from relax.core.controller import recovery, stages
from relax.core.controller.pipeline import Pipeline, StepRows
from relax.core.data import collate

if TYPE_CHECKING:
    from relax.core.controller.step import StepContext


def pipelined_step(state: StepContext) -> dict[str, float]:
    cfg = state.cfg
    if state.pipeline is None:
        state.pipeline = start_pipeline(state)
    pipe = state.pipeline
    step, started = state.step + 1, time.perf_counter()

    # 1. rollout -> queue: the step's rows, scored (async: with reference logprobs and advantages),
    # collated; taken in the background during the previous update when that one prefetched them
    prepare = collate_rows(state.pad_id)
    rows, raw, waited = pipe.prefetch.get(step, prepare, cfg.queue.timeout_s)
    if step < cfg.total_steps:  # the next step's take + collate overlap this step's update
        pipe.prefetch.start(step + 1, prepare)
    metrics = {
        **pipe.rollout_stats.pop(step, {}),
        **rollout_metrics(rows, state.version),
        "time/trainer_wait_s": waited,
    }
    state.failures.record(
        step, rows.samples
    )  # reasons to the console and failures.jsonl (relax.core.failures)

    # 2. filter groups (plugins' relax_filter_group), in group order as colocate trains them
    kept_groups, dropped = stages.filter_groups(rows.groups())
    metrics["groups/dropped"] = float(dropped)
    kept = rows.keep(kept_groups)

    # 3. train: old logprobs (+ what the queue roles did not compute), advantages, one optimizer step
    if kept.samples:
        train(state, pipe, kept, step, metrics, raw=raw if not dropped else None)
    else:
        recovery.commit_step(state, step, trained=False)
    pipe.done(rows)

    # 4. publish the new weights every N steps (opens the staleness gate for the producer)
    if kept.samples and state.version % cfg.weight_sync.every_n_steps == 0:
        with stages.timed(metrics, "sync"):
            metrics.update(pipe.publish_weights(state.version))

    # 5. metrics
    queue_metrics = {k: float(v) for k, v in pipe.queue.metrics().items()}
    elapsed = time.perf_counter() - started
    metrics.update({**queue_metrics, **pipe.rates(queue_metrics), **state.fleet.metrics()})
    metrics["time/step_s"] = elapsed
    metrics["perf/trainer_idle_frac"] = waited / max(elapsed, 1e-9)
    state.end_step(metrics)
    return metrics


def train(
    state: StepContext,
    pipe: Pipeline,
    rows: StepRows,
    step: int,
    metrics: dict[str, float],
    raw: dict | None = None,
) -> None:
    """Forward what the queue roles did not compute, build the batch, run the committed update
    (``raw``: ``rows`` already collated)."""
    cfg, samples = state.cfg, rows.samples
    raw = raw if raw is not None else collate(samples, state.pad_id)
    width = raw["responses"].shape[1]
    with stages.timed(metrics, "logprob"):
        fwd = stages.forward_batch(state.roles, raw, cfg, with_reference=not pipe.use_reference)
    if pipe.use_reference:
        fwd["ref_logprobs"] = rows.column("ref_logprobs", width)
    batch, adv_metrics = stages.prepare_batch(
        samples,
        state.pad_id,
        cfg,
        fwd["old_logprobs"],
        fwd.get("ref_logprobs"),
        values=fwd.get("values"),
        teacher_logprobs=fwd.get("teacher_logprobs"),
        sum_pi_squared=fwd.get("sum_pi_squared"),
        raw=raw,
        advantages=rows.column("advantages", width) if pipe.advantage_role else None,
    )
    metrics.update(adv_metrics)
    if state.sample_log is not None:  # logging.log_samples
        state.sample_log.record(step, samples, batch["advantages"], batch["response_mask"])
    with stages.timed(metrics, "train"):
        metrics.update(stages.train_metrics(recovery.train(state, batch, step)))


def collate_rows(pad_id: int) -> Callable[[StepRows], dict | None]:
    """What the prefetch prepares ahead of the step: its samples collated. Depends only on the rows,
    never on the trainer's state, so it may run during the previous update. None (the step collates
    its kept groups itself) for an empty step, or rows that do not collate: a filter may drop the bad
    group, and otherwise the step raises the error where it always did."""

    def prepare(rows: StepRows) -> dict | None:
        try:
            return collate(rows.samples, pad_id) if rows.samples else None
        except Exception:
            return None

    return prepare


def start_pipeline(state: StepContext) -> Pipeline:
    return Pipeline(
        state.cfg,
        prompts=state.prompts,
        fleet=state.fleet,
        reward=state.roles.reward,
        reference=state.roles.reference,
        pad_id=state.pad_id,
        stop_token_ids=state.stop_token_ids,
        step=state.step,
        version=state.version,
        turns=state.turns,
    )


def rollout_metrics(rows: StepRows, version: int) -> dict[str, float]:
    """Reward / length metrics, per-sample staleness against the trainer's ``version``, mixed versions."""
    samples = rows.samples
    metrics = {
        **stages.sample_metrics(samples),
        **staleness_metrics([version - s.min_version for s in samples]),
    }
    metrics["rollout/mixed_version_frac"] = sum(s.min_version != s.max_version for s in samples) / len(
        samples
    )
    return metrics


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Mean/max plus a histogram (``staleness/count_<s>``) of per-sample staleness."""
    counts = Counter(staleness)
    out = {f"staleness/count_{s}": float(n) for s, n in sorted(counts.items())}
    out["staleness/mean"] = sum(staleness) / max(len(staleness), 1)
    out["staleness/max"] = float(max(staleness, default=0))
    return out


MODE_LOOPS = {"async": pipelined_step, "hybrid": pipelined_step}
