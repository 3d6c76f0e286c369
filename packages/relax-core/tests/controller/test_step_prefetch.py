"""``StepPrefetch``: the async trainer takes (and collates) step ``k + 1`` in a background thread
while step ``k`` trains. A prefetched step must be exactly the step a plain take would have given --
same rows, same order, same collated tensors -- each step taken once; a step whose rows are not
there yet is waited for (and that wait is what the trainer reports); failures and time-outs reach
the step loop, not a background thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax.core.controller.modes import collate_rows
from relax.core.controller.pipeline import StepPrefetch, StepRows
from relax.core.data import Sample
from relax.core.queue import TransferQueue

GROUPS, GROUP_SIZE = 3, 2
STEP_ROWS = GROUPS * GROUP_SIZE


def _put_step(queue: TransferQueue, step: int) -> None:
    """One step's groups, arriving out of group order, responses of uneven lengths (so collating pads)."""
    for g in reversed(range(GROUPS)):
        gid = step * 10 + g
        samples = [
            Sample(
                prompt_ids=[1] * (1 + g),
                group_id=gid,
                index_in_group=i,
                response_ids=[step] * (1 + g + i),
                rollout_logprobs=[-0.5] * (1 + g + i),
                versions=[step - 1] * (1 + g + i),
            )
            for i in range(GROUP_SIZE)
        ]
        queue.put_rows(
            step,
            [{"sample": s, "reward": (float(gid + i), {})} for i, s in enumerate(samples)],
            group_ids=[gid] * GROUP_SIZE,
        )


def _take_from(queue: TransferQueue, log: list[int] | None = None):
    def take(step: int) -> tuple[StepRows, float]:
        if log is not None:
            log.append(step)
        batch = queue.get("trainer", ["sample", "reward"], STEP_ROWS, timeout=5.0, partition=step)
        return StepRows.of(batch), 0.0

    return take


def _queue(steps: int) -> TransferQueue:
    queue = TransferQueue(capacity=steps * STEP_ROWS, consumers=["trainer"])
    for step in range(1, steps + 1):
        _put_step(queue, step)
    return queue


def _rows_view(rows: StepRows) -> list[tuple]:
    return [(s.group_id, s.index_in_group, s.reward, tuple(s.response_ids)) for s in rows.samples]


def test_prefetched_steps_are_exactly_the_steps_a_plain_take_gives():
    steps, prepare = 4, collate_rows(pad_id=0)
    taken: list[int] = []
    prefetch = StepPrefetch(_take_from(_queue(steps), taken), lambda: "timed out")
    plain = _take_from(_queue(steps))
    try:
        for step in range(1, steps + 1):
            rows, raw, _ = prefetch.get(step, prepare, timeout_s=5.0)
            if step < steps:
                prefetch.start(step + 1, prepare)
                prefetch.start(step + 1, prepare)  # a second start takes nothing twice
            expected, _ = plain(step)
            assert _rows_view(rows) == _rows_view(expected)
            want = prepare(expected)
            assert raw.keys() == want.keys()
            assert all(torch.equal(raw[k], want[k]) for k in want)
        assert taken == [1, 2, 3, 4]  # each step once, in order
    finally:
        prefetch.close()


def test_a_step_prefetched_before_its_rows_exist_waits_for_them():
    queue = TransferQueue(capacity=2 * STEP_ROWS, consumers=["trainer"])
    _put_step(queue, 1)
    prefetch = StepPrefetch(_take_from(queue), lambda: "timed out")
    prepare = collate_rows(pad_id=0)
    try:
        rows, _, waited = prefetch.get(1, prepare, timeout_s=5.0)
        assert waited < 1.0 and len(rows.samples) == STEP_ROWS
        prefetch.start(2, prepare)  # step 2's rows are still being generated
        threading.Timer(0.3, _put_step, args=(queue, 2)).start()
        rows, raw, waited = prefetch.get(2, prepare, timeout_s=5.0)
        assert waited >= 0.25  # the trainer's wait for data, not the prefetch thread's
        assert {s.group_id for s in rows.samples} == {20, 21, 22} and raw["responses"].shape == (STEP_ROWS, 4)
    finally:
        prefetch.close()


def test_failures_and_time_outs_reach_the_step_loop():
    def broken(step: int) -> tuple[StepRows, float]:
        raise RuntimeError(f"reward role died before step {step}")

    prefetch = StepPrefetch(broken, lambda: "timed out")
    prefetch.start(3, collate_rows(0))
    with pytest.raises(RuntimeError, match="before step 3"):
        prefetch.get(3, collate_rows(0), timeout_s=5.0)
    prefetch.close()

    release = threading.Event()

    def slow(step: int) -> tuple[StepRows, float]:
        release.wait(5.0)
        return StepRows([], [], {}), 0.0

    prefetch = StepPrefetch(slow, lambda: "trainer waited 0s for 6 rows")
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="trainer waited 0s for 6 rows"):
        prefetch.get(1, collate_rows(0), timeout_s=0.2)
    assert time.perf_counter() - started < 2.0
    release.set()
    prefetch.close()


def test_rows_that_do_not_collate_are_left_to_the_step():
    bad = Sample(prompt_ids=[1], group_id=0, index_in_group=0, response_ids=[2, 3], rollout_logprobs=[-1.0])
    rows = StepRows([(1, 0)], [bad], {})
    assert collate_rows(0)(rows) is None  # a filter may drop it; else train() collates and raises there
    assert collate_rows(0)(StepRows([], [], {})) is None
