"""What a perfect driver would reach on the simulated cluster (``sim_plugin.py``): the ceiling that
``bench/async_overlap.py`` compares its measured ratios with.

Replays the same model in plain Python, no Ray: response lengths from the sim engine's log-normal,
generated on one FIFO pool of all the engines' slots in ``CHUNK_TOKENS`` chunks, a train step that
takes exactly the sim trainer's time, and the staleness gate of
``relax.core.controller.pipeline`` (step ``k`` starts generating once version ``k - 1 - s`` is
published). The driver, weight publishes included, costs nothing, so async can only get below this. At
small staleness the trainer still waits: a step's longest response (up to ``max_len`` tokens) must
fit into the ``s`` updates that run meanwhile.
"""

from __future__ import annotations

import heapq
import math
import random

from sim_plugin import CHUNK_TOKENS, SimEngineParams, SimTrainerParams

ENGINE, TRAINER = SimEngineParams(), SimTrainerParams()  # the sim's defaults, as the bench runs it


def _generation_s(length: int, engine: SimEngineParams) -> float:
    return math.ceil(length / CHUNK_TOKENS) * CHUNK_TOKENS * engine.token_s


def _finish_time(lengths: list[int], start: float, free: list[float], engine: SimEngineParams) -> float:
    """When the last of ``lengths`` (submitted at ``start``) finishes on the FIFO slot pool ``free``."""
    last = start
    for length in lengths:
        end = max(heapq.heappop(free), start) + _generation_s(length, engine)
        heapq.heappush(free, end)
        last = max(last, end)
    return last


def ideal_seconds_per_step(
    staleness: int | None,
    rows: int,
    slots: int,
    steps: int = 400,
    seed: int = 0,
    engine: SimEngineParams = ENGINE,
    trainer: SimTrainerParams = TRAINER,
) -> float:
    """Mean seconds per step after a warm-up: async at ``staleness``, or colocate (generate the whole
    step on idle engines, then train) for ``None``."""
    rng = random.Random(seed)
    mu = math.log(engine.mean_len) - engine.sigma**2 / 2
    lengths = [
        [max(1, min(engine.max_len, int(rng.lognormvariate(mu, engine.sigma)))) for _ in range(rows)]
        for _ in range(steps + 1)
    ]

    def train_s(k: int) -> float:
        return sum(lengths[k]) * trainer.train_token_s

    if staleness is None:
        per_step = [
            _finish_time(lengths[k], 0.0, [0.0] * slots, engine) + train_s(k) for k in range(1, steps + 1)
        ]
        warm = steps // 10
        return sum(per_step[warm:]) / (steps - warm)
    published, finished, free = [0.0], [0.0], [0.0] * slots  # version v published at published[v]
    for k in range(1, steps + 1):
        while len(published) <= max(0, k - 1 - staleness):  # train the steps the gate waits for
            v = len(published)
            published.append(max(published[v - 1], finished[v]) + train_s(v))
        finished.append(_finish_time(lengths[k], published[max(0, k - 1 - staleness)], free, engine))
    while len(published) <= steps:
        v = len(published)
        published.append(max(published[v - 1], finished[v]) + train_s(v))
    warm = steps // 10
    return (published[steps] - published[warm]) / (steps - warm)


def ideal_ratio(staleness: int, rows: int, slots: int) -> float:
    """Async at ``staleness`` vs colocate, both with a driver that costs nothing."""
    return ideal_seconds_per_step(None, rows, slots) / ideal_seconds_per_step(staleness, rows, slots)
