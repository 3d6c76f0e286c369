"""Transports that hand whole buckets to each engine's ``update_weights``: in-process and Ray object store."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from relax.core.weight_sync.base import bucket_nbytes, is_actor
from relax.core.weight_sync.flat import ZeroCopyBucket
from relax.core.weight_sync.transport import Peers, Transport


@dataclass(frozen=True)
class InProcessParams:
    """``weight_sync.params`` of ``in_process`` (none)."""


@dataclass(frozen=True)
class ObjectStoreParams:
    """``weight_sync.params`` of ``object_store``."""

    max_inflight: int = 2  # buckets in the object store at once (the trainer's extra memory)

    def validate(self) -> list[str]:
        return [] if self.max_inflight >= 1 else [f"max_inflight: must be >= 1, got {self.max_inflight}"]


class InProcessSync(Transport):
    """Colocated: each bucket goes to every local engine as the trainer's own tensors (the engine
    copies them into its parameters). Engine actors also work, at one object-store copy of the bucket
    per engine (``object_store`` shares one)."""

    name = "in_process"
    config = InProcessParams

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        for i, bucket in enumerate(trainer.export_weights(self.bucket_bytes)):
            args = [(ZeroCopyBucket(bucket) if is_actor(e) else bucket, version) for e in peers.engines]
            peers.wait(peers.start_each("update", args), f"update_weights(bucket {i}, version {version})")
            yield bucket_nbytes(bucket)


class ObjectStoreSync(Transport):
    """One ``ray.put`` per bucket in the trainer's process; every engine actor receives the same
    ObjectRef, which Ray resolves in the engine's process to read-only views of the shared buffer
    (the engine copies them into its parameters). Up to ``max_inflight`` buckets are in flight."""

    name = "object_store"
    config = ObjectStoreParams

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        import ray

        inflight: deque[tuple[dict, str]] = deque()  # (pending calls, what)
        for i, bucket in enumerate(trainer.export_weights(self.bucket_bytes)):
            ref = ray.put(ZeroCopyBucket(bucket))
            local = None if all(is_actor(e) for e in peers.engines) else ray.get(ref, timeout=self.timeout_s)
            args = [(ref if is_actor(e) else local, version) for e in peers.engines]
            inflight.append(
                (peers.start_each("update", args), f"update_weights(bucket {i}, version {version})")
            )
            del ref, local, args  # the object is freed once every engine has read it
            while len(inflight) >= self.params.max_inflight:
                peers.wait(*inflight.popleft())
            yield bucket_nbytes(bucket)
        while inflight:
            peers.wait(*inflight.popleft())
