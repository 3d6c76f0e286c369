"""Routing generation over several engine actors, group by group, with abort-and-resubmit.

The router sends each chunk of whole groups to the engine with the fewest outstanding requests
and yields groups as soon as their chunk returns, so downstream roles start on early groups while
late (long-tail) ones are still generating.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import ray

from relax.core.controller.samples import apply_result, request_for
from relax.core.data import Sample
from relax.core.protocols import SamplingParams


class EngineRouter:
    """Least-outstanding-requests load balancing over engine actor handles."""

    def __init__(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.outstanding = [0] * len(engines)
        self._lock = threading.Lock()  # several rollout steps submit concurrently

    def submit(self, requests: list[Any]) -> tuple[Any, int]:
        with self._lock:
            idx = min(range(len(self.engines)), key=self.outstanding.__getitem__)
            self.outstanding[idx] += len(requests)
        return self.engines[idx].generate.remote(requests), idx

    def done(self, idx: int, n: int) -> None:
        with self._lock:
            self.outstanding[idx] -= n


def stream_groups(
    router: EngineRouter,
    groups: list[list[Sample]],
    params: SamplingParams,
    seed: int,
    step: int,
    chunks_per_engine: int = 2,
    timeout_s: float = 600.0,
) -> Iterator[tuple[list[list[Sample]], int]]:
    """Generate every group; yield (finished groups, number of aborted-and-resubmitted requests).

    A request that comes back with finish reason ``"abort"`` (weights changed under it with
    ``rollout.partial_rollout: abort``) is resubmitted from scratch with the same seed.
    """
    n_chunks = max(1, min(len(groups), chunks_per_engine * len(router.engines)))
    pending: dict[Any, tuple[int, list[list[Sample]], list[Sample]]] = {}

    def send(chunk_groups: list[list[Sample]], samples: list[Sample]) -> None:
        ref, idx = router.submit([request_for(s, params, seed, step) for s in samples])
        pending[ref] = (idx, chunk_groups, samples)

    for i in range(n_chunks):
        chunk = groups[i::n_chunks]
        send(chunk, [s for g in chunk for s in g])
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"rollout: {len(pending)} generate calls did not finish within {timeout_s:.0f}s")
        idx, chunk_groups, samples = pending.pop(ready[0])
        router.done(idx, len(samples))
        results = ray.get(ready[0])
        aborted = []
        for sample, result in zip(samples, results, strict=True):
            if result.finish_reason == "abort":
                aborted.append(sample)
            else:
                apply_result(sample, result)
        if aborted:
            send(chunk_groups, aborted)
            yield [], len(aborted)
        else:
            yield chunk_groups, 0
