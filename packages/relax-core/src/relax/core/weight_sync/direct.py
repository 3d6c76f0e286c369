"""Transports that hand buckets to ``engine.update_weights`` directly: in-process and Ray object store."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from relax.core.weight_sync.base import (
    bucket_nbytes,
    call_all,
    engine_names,
    is_actor,
    iter_bucket_refs,
    iter_buckets,
    start,
    stats,
    verify_versions,
    wait_all,
)


class InProcessSync:
    """Colocated mode: every bucket goes to each engine as the trainer's own tensors (no copy here;
    the engine copies into its parameters). Actor engines also work, at one pickled copy per engine."""

    def __init__(self, timeout_s: float = 60.0, bucket_bytes: int = 64 << 20):
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        names = engine_names(engines)
        nbytes = buckets = 0
        for bucket in iter_buckets(trainer, self.bucket_bytes, self.timeout_s):
            what = f"update_weights(bucket {buckets}, version {version})"
            call_all(engines, names, "update_weights", (bucket, version), self.timeout_s, what)
            nbytes += bucket_nbytes(bucket)
            buckets += 1
        verify_versions(engines, names, version, self.timeout_s)
        return stats(t0, nbytes, buckets, len(engines))


class ObjectStoreSync:
    """One object-store put per bucket; every engine receives the same ObjectRef, which Ray resolves
    in the engine process to a list of (name, tensor) that are read-only views of the shared buffer
    (engines copy them into their parameters). Up to ``max_inflight`` buckets are in flight."""

    def __init__(self, timeout_s: float = 60.0, bucket_bytes: int = 64 << 20, max_inflight: int = 2):
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.max_inflight = max(1, max_inflight)

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        names = engine_names(engines)
        inflight: deque[tuple[str, dict]] = deque()
        nbytes = buckets = 0
        for ref, size in iter_bucket_refs(trainer, self.bucket_bytes, self.timeout_s):
            value = None if all(is_actor(e) for e in engines) else ray.get(ref, timeout=self.timeout_s)
            pending = {
                n: start(e, "update_weights", ref if is_actor(e) else value, version)
                for n, e in zip(names, engines, strict=True)
            }
            inflight.append((f"update_weights(bucket {buckets}, version {version})", pending))
            nbytes += size
            buckets += 1
            while len(inflight) >= self.max_inflight:
                what, pending = inflight.popleft()
                wait_all(pending, self.timeout_s, what)
        while inflight:
            what, pending = inflight.popleft()
            wait_all(pending, self.timeout_s, what)
        verify_versions(engines, names, version, self.timeout_s)
        return stats(t0, nbytes, buckets, len(engines))
