"""Async/hybrid data plane: a rollout producer and role pumps connected by the transfer queue.

Threads in the driver move rows between the queue actor and the role actors (engines, reward,
reference); the compute happens in the actors, concurrently with the trainer.

Staleness gate: rows for step ``k`` are trained when the trainer holds version ``k - 1``; so the
producer may start generating step ``k`` only once the engines serve version ``>= k - 1 -
max_staleness``. Every token then comes from a version within the bound, even when a weight update
lands mid-sequence (partial rollout), because engine versions only grow.

Checkpoints record the data position after the last *trained* step (``PromptSource``); rows
generated ahead of it are regenerated after a resume (nothing lost, nothing trained twice).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from relax.core import lazy_ray
from relax.core.controller import faults, stages
from relax.core.controller.prompts import PromptSource
from relax.core.controller.router import stream_groups
from relax.core.controller.samples import sampling_params
from relax.core.data import Sample, collate
from relax.core.plugins import get_plugin_manager
from relax.core.queue import Batch

log = logging.getLogger("relax")

POLL_S = 0.5
CLOSE_S = 10.0  # longest close() waits for the role threads to notice the stop


def _row_lists(values: torch.Tensor, samples: list[Sample]) -> list[list[float]]:
    """(B, R) tensor -> one list per sample, trimmed to its response length."""
    return [values[i, : len(s.response_ids)].tolist() for i, s in enumerate(samples)]


def pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


@lazy_ray.remote(num_cpus=0)
def advantage_task(
    samples: list[Sample], pad_id: int, cfg: Any, ref_rows: list[list[float]] | None
) -> list[list[float]]:
    """Advantage role (CPU, stateless): a whole step batch so global whitening sees every row."""
    from relax.core.controller.stages import prepare_batch

    raw = collate(samples, pad_id)
    ref = pad_rows(ref_rows, raw["response_mask"].shape[1]) if ref_rows is not None else None
    batch, _ = prepare_batch(samples, pad_id, cfg, raw["rollout_logprobs"], ref, raw=raw)
    return _row_lists(batch["advantages"], samples)


class Pipeline:
    """The producer and role pumps of one run, started at trainer step ``step`` / weight ``version``.

    It owns its threads and the queue; everything else is passed in: prompts come from ``prompts``,
    generation goes through ``fleet``'s router, weights are published through ``fleet``."""

    def __init__(
        self,
        cfg: Any,
        *,
        prompts: PromptSource,
        fleet: Any,
        reward: Any,
        reference: Any | None,
        pad_id: int,
        stop_token_ids: list[int],
        step: int,
        version: int,
        turns: Any = None,
    ) -> None:
        self.cfg, self.prompts, self.fleet, self.turns = cfg, prompts, fleet, turns
        self.reward, self.reference, self.pad_id = reward, reference, pad_id
        self.params = sampling_params(cfg, stop_token_ids)
        self.start_step = step
        self.group_size = cfg.rollout.n_samples_per_prompt
        self.step_rows = cfg.rollout.prompts_per_step * self.group_size
        # hybrid: reference logprobs and advantages inside the train step; async: queue roles, except
        # that advantages needing the critic's current values, or anything else only the trainer
        # provides (TRAINER_CAPABILITIES, e.g. sum_pi_squared), are computed in the train step too
        from relax.core.algorithms import TRAINER_CAPABILITIES, config_needs

        needs_trainer = config_needs(cfg.algorithm) & set(TRAINER_CAPABILITIES)
        self.use_reference = cfg.mode == "async" and reference is not None
        self.advantage_role = cfg.mode == "async" and not (cfg.algorithm.critic.enable or needs_trainer)
        consumers = ["reward", "trainer"] + (["advantage"] if self.advantage_role else [])
        consumers += ["reference"] if self.use_reference else []
        self.trainer_columns = ["sample", "reward"] + (["advantages"] if self.advantage_role else [])
        self.trainer_columns += ["ref_logprobs"] if self.use_reference else []
        queue_factory = get_plugin_manager().get("queue", cfg.queue.name)
        self.queue = queue_factory(capacity=(cfg.max_staleness + 2) * self.step_rows, consumers=consumers)
        self.router = fleet.router
        self.engine_version = version
        self.gate = threading.Condition()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.rollout_stats: dict[int, dict[str, float]] = {}
        self.prefetch = StepPrefetch(self.take, self._timeout_message)
        self._last_rates: tuple[float, dict[str, float]] = (time.perf_counter(), {})
        self.threads: list[threading.Thread] = []
        self.threads += [self._spawn("rollout", self._produce), self._spawn("reward", self._reward_pump)]
        if self.advantage_role:
            self.threads.append(self._spawn("advantage", self._advantage_pump))
        if self.use_reference:
            self.threads.append(self._spawn("reference", self._reference_pump))

    # ------------------------------------------------------------------ plumbing
    def _spawn(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                fn()
            except BaseException as exc:  # surfaced to the trainer loop by take(), with its own type
                if not self.stop.is_set():
                    log.error("%s role failed: %s", name, exc)
                    exc.add_note(f"(in the {name} thread of the async pipeline)")
                    self.errors.append(exc)
                    self.stop.set()

        thread = threading.Thread(target=guarded, name=f"relax-{name}", daemon=True)
        thread.start()
        return thread

    def _check(self) -> None:
        if self.errors:
            raise self.errors[0]

    def _pump(
        self,
        consumer: str,
        columns: list[str],
        batch_size: int,
        work: Callable[[Batch], dict[str, list]],
        by_step: bool = False,
    ) -> None:
        """Move rows through one role until stopped; ``by_step`` takes whole steps in order."""
        step = self.start_step + 1
        while not self.stop.is_set():
            try:
                batch = self.queue.get(
                    consumer, columns, batch_size, timeout=POLL_S, partition=step if by_step else None
                )
            except TimeoutError:
                continue
            self.queue.add_columns(batch.keys, work(batch))
            self.queue.ack(consumer, batch.keys)
            step += 1

    # ------------------------------------------------------------------ roles
    def _produce(self) -> None:
        """Draw prompts in order as the gate opens; generate up to ``max_staleness + 1`` steps at
        once, so a step's long-tail stragglers overlap the next steps' requests."""
        cfg, step = self.cfg, self.start_step
        while not self.stop.is_set() and step < cfg.total_steps:
            step += 1
            with self.gate:
                self.gate.wait_for(
                    lambda s=step: self.stop.is_set() or self.engine_version >= s - 1 - cfg.max_staleness
                )
            if self.stop.is_set():
                return
            groups = self.prompts.draw(step)
            self.threads.append(
                self._spawn(f"rollout-step-{step}", lambda s=step, g=groups: self._generate_step(s, g))
            )

    def _generate_step(self, step: int, groups: list[list[Sample]]) -> None:
        cfg = self.cfg
        started, tokens, resubmitted = time.perf_counter(), 0, 0
        for finished, n_aborted in stream_groups(
            self.router,
            groups,
            self.params,
            cfg.seed,
            step,
            timeout_s=cfg.rollout.timeout_s,
            turns=self.turns,
        ):
            resubmitted += n_aborted
            for group in finished:
                tokens += sum(len(s.response_ids) for s in group)
                self.queue.put_rows(
                    step,
                    [{"sample": s} for s in group],
                    group_ids=[group[0].group_id] * len(group),
                    version=[(s.min_version, s.max_version) for s in group],
                    timeout=cfg.queue.timeout_s,
                )
        seconds = time.perf_counter() - started
        self.rollout_stats[step] = {
            "time/generate_s": seconds,
            "perf/rollout_tokens_per_s": tokens / max(seconds, 1e-9),
            "rollout/resubmitted_requests": float(resubmitted),
        }

    def _reward_pump(self) -> None:
        reward = self.reward

        def work(batch: Batch) -> dict[str, list]:
            scored, _ = stages.score(reward, batch.data["sample"], self.cfg)
            return {"reward": [(s.reward, s.reward_info) for s in scored]}

        self._pump("reward", ["sample"], self.group_size, work)

    def _reference_pump(self) -> None:
        reference, pad_id = self.reference, self.pad_id

        def work(batch: Batch) -> dict[str, list]:
            samples = batch.data["sample"]
            ref = reference.forward_logprobs.remote(collate(samples, pad_id))
            logprobs = faults.wait(ref, self.cfg.trainer.timeout_s, "reference", "forward_logprobs")
            return {"ref_logprobs": _row_lists(logprobs, samples)}

        self._pump("reference", ["sample"], self.group_size, work)

    def _advantage_pump(self) -> None:
        columns = ["sample", "reward"] + (["ref_logprobs"] if self.use_reference else [])

        def work(batch: Batch) -> dict[str, list]:
            samples = merge_rewards(batch)
            ref = batch.data["ref_logprobs"] if self.use_reference else None
            task = advantage_task.remote(samples, self.pad_id, self.cfg, ref)
            return {"advantages": faults.wait(task, self.cfg.trainer.timeout_s, "advantage", "compute")}

        self._pump("advantage", columns, self.step_rows, work, by_step=True)

    # ------------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[StepRows, float]:
        """Block for ``step``'s rows (whole groups with every trainer column) until they are all there
        or the pipeline stops; returns them, in group order with rewards merged into the samples, and
        the wait. The trainer calls it through :attr:`prefetch`, which bounds the wait."""
        started = time.perf_counter()
        while True:
            self._check()
            if self.stop.is_set():
                raise RuntimeError(
                    f"the async pipeline closed while the trainer waited for step {step}'s rows"
                )
            try:
                batch = self.queue.get(
                    "trainer", self.trainer_columns, self.step_rows, timeout=POLL_S, partition=step
                )
                return StepRows.of(batch), time.perf_counter() - started
            except TimeoutError:
                continue

    def _timeout_message(self) -> str:
        return (
            f"trainer waited {self.cfg.queue.timeout_s:.0f}s for {self.step_rows} rows with "
            f"{self.trainer_columns}; queue: {self.queue.metrics()}"
        )

    def done(self, rows: StepRows) -> None:
        """The trainer is finished with ``rows`` (trained or dropped): the queue may evict them."""
        self.queue.ack("trainer", rows.keys)

    def publish_weights(self, version: int) -> dict[str, float]:
        """Have the fleet push the trainer's weights to every engine as ``version`` (in-flight sequences
        pause, or abort, meanwhile; a dead or silent engine is evicted and replaced instead of failing
        the step), then open the staleness gate for ``version``. Returns ``weight_sync/*`` metrics."""
        metrics = self.fleet.publish(version, abort=self.cfg.rollout.partial_rollout == "abort")
        with self.gate:
            self.engine_version = version
            self.gate.notify_all()
        return metrics

    def rates(self, queue_metrics: dict[str, float]) -> dict[str, float]:
        """Rows produced / consumed per second (per role) since the previous call."""
        now = time.perf_counter()
        counters = {
            k: v
            for k, v in queue_metrics.items()
            if k.startswith(("queue/rows_produced", "queue/rows_consumed/"))
        }
        last_time, last = self._last_rates
        self._last_rates = (now, counters)
        dt = max(now - last_time, 1e-9)
        return {f"{k}_per_s": (v - last.get(k, 0.0)) / dt for k, v in counters.items()}

    def close(self) -> None:
        self.stop.set()
        with self.gate:
            self.gate.notify_all()
        self.prefetch.close()  # its take sees ``stop`` within POLL_S and ends
        deadline = time.monotonic() + CLOSE_S  # threads are daemons: a stuck one cannot hold up shutdown
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.queue.close()  # the Ray queue kills its actor (idempotent: emergency checkpoint, then shutdown)


class StepPrefetch:
    """The next step's rows taken (and ``prepare``-d, e.g. collated) by one background thread while the
    trainer runs the current step, so the trainer does not sit idle through the driver's take and
    collate between two updates. Each step is taken once, in order, from its own queue partition:
    exactly the rows the step would have taken itself, only earlier. Whatever depends on the trainer's
    state (metrics against its version, filters, old logprobs) stays in the step, after the take."""

    def __init__(
        self, take: Callable[[int], tuple[StepRows, float]], timeout_message: Callable[[], str]
    ) -> None:
        self._take, self._timeout_message = take, timeout_message
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-prefetch")
        self._pending: dict[int, Future] = {}

    def start(self, step: int, prepare: Callable[[StepRows], Any]) -> None:
        """Begin taking ``step``'s rows now (no-op if already begun)."""
        if step not in self._pending:
            self._pending[step] = self._executor.submit(self._take_prepared, step, prepare)

    def _take_prepared(self, step: int, prepare: Callable[[StepRows], Any]) -> tuple[StepRows, Any]:
        rows, _ = self._take(step)
        return rows, prepare(rows)

    def get(
        self, step: int, prepare: Callable[[StepRows], Any], timeout_s: float
    ) -> tuple[StepRows, Any, float]:
        """``step``'s rows and ``prepare(rows)``, prefetched if :meth:`start` ran for it, else taken now;
        plus how long the caller blocked (the trainer's wait for data). Raises what the take raised,
        or ``TimeoutError`` after ``timeout_s``."""
        started = time.perf_counter()
        future = self._pending.pop(step, None)
        if future is None:
            future = self._executor.submit(self._take_prepared, step, prepare)
        try:
            rows, prepared = future.result(timeout=timeout_s)
        except TimeoutError:
            if not future.done():
                raise TimeoutError(self._timeout_message()) from None
            raise  # the take's own TimeoutError
        return rows, prepared, time.perf_counter() - started

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def merge_rewards(batch: Batch) -> list[Sample]:
    samples = batch.data["sample"]
    for sample, (reward, info) in zip(samples, batch.data["reward"], strict=True):
        sample.reward, sample.reward_info = reward, info
    return samples


@dataclass
class StepRows:
    """One step's rows as the trainer uses them: samples in group order (rewards merged) and the
    per-token columns the queue roles computed (``advantages``, ``ref_logprobs``), row ``i`` of each
    column belonging to ``samples[i]``. Filtering keeps whole groups, so rows stay aligned by position."""

    keys: list[Any]  # every queue key of the step: acknowledged once the trainer is done with it
    samples: list[Sample]
    columns: dict[str, list[list[float]]]

    @classmethod
    def of(cls, batch: Batch) -> StepRows:
        samples = merge_rewards(batch)
        order = sorted(range(len(samples)), key=lambda i: (samples[i].group_id, samples[i].index_in_group))
        columns = {
            c: [batch.data[c][i] for i in order] for c in ("advantages", "ref_logprobs") if c in batch.data
        }
        return cls(list(batch.keys), [samples[i] for i in order], columns)

    def groups(self) -> list[list[Sample]]:
        """The samples as groups, ascending group id, each in index order."""
        groups: dict[int, list[Sample]] = {}
        for s in self.samples:
            groups.setdefault(s.group_id, []).append(s)
        return list(groups.values())

    def keep(self, groups: list[list[Sample]]) -> StepRows:
        """The rows of ``groups`` (a subset of :meth:`groups`, e.g. what the filters kept)."""
        kept = {g[0].group_id for g in groups}
        rows = [i for i, s in enumerate(self.samples) if s.group_id in kept]
        columns = {c: [v[i] for i in rows] for c, v in self.columns.items()}
        return StepRows(self.keys, [self.samples[i] for i in rows], columns)

    def column(self, name: str, width: int) -> torch.Tensor:
        """A queue role's per-token column as a (B, width) tensor, zero-padded."""
        return pad_rows(self.columns[name], width)
