"""Plain ``def score`` calls in a few daemon threads ("lanes") that each take the next sample as they
finish one, instead of one thread hand-off per sample.

A cheap rule (a plugin's regex reward) costs microseconds; handing each call to a thread and its
result back to the event loop costs ~0.2 ms, which was most of a step's reward time. Lanes keep the
same guarantees: at most ``lanes`` calls run at once (the reward's ``max_concurrency``), each call is
limited to ``timeout_s`` *from its own start* (time spent queued never counts), and a call past its
limit is abandoned with its lane, which a fresh lane replaces, so the calls after it are scored as
usual and never blamed for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from relax.core.rewards.bounded import in_daemon_thread

#: one sample's outcome: ("ok", value) | ("error", exception) | ("timeout", None)
Outcome = tuple[str, Any]


async def score_in_lanes(
    fn: Callable[[Any], Any],
    samples: Sequence[Any],
    timeout_s: float,
    lanes: int,
    stop_on_failure: bool = False,
) -> list[Outcome | None]:
    """``fn(sample)`` for every sample, in order of start; with ``stop_on_failure`` no call starts after
    one failed or timed out (its sample's outcome is ``None``)."""
    lock = threading.Lock()
    pending = iter(range(len(samples)))
    started: dict[int, float] = {}
    outcomes: dict[int, Outcome] = {}
    running: dict[int, int] = {}  # lane id -> the sample it is calling
    abandoned: set[int] = set()  # lanes whose call ran past its limit: they take nothing more
    failures = [0]  # calls that raised or ran past their limit

    def lane(lane_id: int) -> None:
        while True:
            with lock:
                stop = lane_id in abandoned or (stop_on_failure and failures[0] > 0)
                index = None if stop else next(pending, None)
                if index is None:
                    return
                running[lane_id], started[index] = index, time.perf_counter()
            try:
                outcome: Outcome = ("ok", fn(samples[index]))
            except BaseException as exc:  # noqa: BLE001  # the runner names it with the sample
                outcome = ("error", exc)
            with lock:
                failures[0] += outcome[0] != "ok" and index not in outcomes
                outcomes.setdefault(index, outcome)  # a late result of an abandoned call is dropped
                running.pop(lane_id, None)

    lane.__name__ = getattr(
        fn, "__name__", "score"
    )  # the thread's name: relax-reward-<fn> (a hung one shows it)
    live = {lane_id: in_daemon_thread(lane, lane_id) for lane_id in range(min(lanes, len(samples)))}
    next_id = len(live)
    while live:
        with lock:
            calls = [
                (lane_id, started[i])
                for lane_id, i in running.items()
                if lane_id in live and i not in outcomes
            ]
        wait_s = (
            min((t + timeout_s for _, t in calls), default=time.perf_counter() + timeout_s)
            - time.perf_counter()
        )
        done, _ = await asyncio.wait(
            set(live.values()), timeout=max(wait_s, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
        live = {lane_id: f for lane_id, f in live.items() if f not in done}
        now = time.perf_counter()
        with lock:
            overdue = [
                lane_id
                for lane_id, i in running.items()
                if lane_id in live and i not in outcomes and now - started[i] >= timeout_s
            ]
            for lane_id in overdue:  # abandon the call and its lane; a fresh lane takes the rest
                outcomes[running[lane_id]] = ("timeout", None)
                abandoned.add(lane_id)
                failures[0] += 1
        for lane_id in overdue:
            del live[lane_id]
            live[next_id] = in_daemon_thread(lane, next_id)
            next_id += 1
    return [outcomes.get(i) for i in range(len(samples))]
