"""``shared_memory``: colocated engines read the trainer's weights from one shared-memory segment.

The trainer's process copies every bucket once into a file on a RAM-backed filesystem
(``/dev/shm``), mapped by both sides; one call per engine then applies the whole version (begin,
each bucket as views of the mapping, end) -- nothing is serialised, nothing crosses the object
store, and a sync is one round trip per engine instead of one per bucket. The engine copies the
views into its parameters (as with every transport), so the segment is reused by the next sync.

Safety: the segment's header carries the version last written; an engine told to apply version
``v`` from a segment stamped otherwise (a sender that skipped its copy, or a segment recycled under
it) fails naming the segment, never applies stale weights silently. Engines must see the same
filesystem as the trainer (one machine): a missing segment is an error that says so.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax.core.weight_sync.base import WeightSyncError, bucket_nbytes, check_versions
from relax.core.weight_sync.flat import ALIGN, Layout, pack_into, plan, unpack
from relax.core.weight_sync.transport import Peers, Receiver, Transport

HEADER = ALIGN  # int64 version stamp, then padding to keep the payload aligned
Placed = list[tuple[int, Layout]]  # (byte offset of a bucket in the segment, its layout)


@dataclass(frozen=True)
class SharedMemoryParams:
    """``weight_sync.params`` of ``shared_memory``."""

    directory: str = "/dev/shm"  # a RAM-backed filesystem that the trainer and every engine see

    def validate(self) -> list[str]:
        return (
            []
            if self.directory
            else ["directory: must name a directory (a RAM-backed filesystem such as /dev/shm)"]
        )


def _map(path: str, size: int) -> torch.Tensor:
    """The file as a writable uint8 tensor sharing its pages (MAP_SHARED)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _stamp(flat: torch.Tensor) -> torch.Tensor:
    return flat[:8].view(torch.int64)


class SharedMemoryReceiver(Receiver):
    """Maps the sender's segment (once per segment) and applies a whole version in one call."""

    def __init__(self, transport: Transport, engine: Any):
        super().__init__(transport, engine)
        self.path: str | None = None
        self.flat: torch.Tensor | None = None

    def apply(self, path: str, size: int, placed: Placed, version: int) -> int:
        """begin, one ``update_weights`` per bucket (views of the segment), end; returns the version served."""
        if path != self.path:
            if not os.path.exists(path):
                raise WeightSyncError(
                    f"shared-memory segment {path} is not visible here: the shared_memory transport needs "
                    "every engine on the trainer's machine (use object_store or broadcast across machines)"
                )
            self.flat, self.path = _map(path, size), path
        stamp = int(_stamp(self.flat)[0])
        if stamp != version:
            raise WeightSyncError(
                f"shared-memory segment {path} holds version {stamp}, not {version}: the trainer's "
                "copy did not happen; refusing to apply stale weights"
            )
        self.begin(version)
        for base, layout in placed:
            self.update(unpack(self.flat[base:], layout), version)
        return self.end(version)

    def close(self) -> None:
        self.flat = self.path = None


class SharedMemorySync(Transport):
    """Trainer → colocated engines through one reused shared-memory file (see the module docstring)."""

    name = "shared_memory"
    reach = "host"  # one file of the trainer's machine: refused across nodes (weight_sync.nodes)
    config = SharedMemoryParams
    receiver_cls = SharedMemoryReceiver

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self._segment: tuple[str, int, torch.Tensor] | None = None  # (path, size, mapping)
        self._generation = 0
        self._cleanup = weakref.finalize(self, _unlink, [])

    def _segment_for(self, size: int) -> tuple[str, torch.Tensor]:
        """A segment of at least ``size`` bytes, created (or replaced by a bigger one) on demand."""
        if self._segment is None or self._segment[1] < size:
            directory = Path(self.params.directory)
            if not directory.is_dir():
                raise WeightSyncError(f"weight_sync.params.directory: {directory} is not a directory")
            self.close()
            self._generation += 1
            path = str(directory / f"relax-weights-{self.uid[:12]}-{os.getpid()}-{self._generation}")
            with open(path, "wb") as f:
                f.truncate(size)
            self._cleanup = weakref.finalize(self, _unlink, [path])
            self._segment = (path, size, _map(path, size))
        path, _, flat = self._segment
        return path, flat

    def push(self, trainer: Any, engines: list[Any], version: int) -> Iterator[dict[str, float]]:
        """Copy every bucket into the segment, stamp it, then one ``apply`` per engine; yields totals."""
        peers = Peers(self, engines)
        yield {"bytes": 0, "buckets": 0}
        buckets = list(trainer.export_weights(self.bucket_bytes))  # views: copied once, below
        placed: Placed = []
        size = HEADER
        for bucket in buckets:
            layout, nbytes = plan(bucket)
            placed.append((size, layout))
            size += nbytes
        path, flat = self._segment_for(size)
        _stamp(flat)[0] = -1  # a half-written segment is never taken for a complete one
        for (base, layout), bucket in zip(placed, buckets, strict=True):
            pack_into(flat[base:], bucket, layout)
        _stamp(flat)[0] = version
        served = peers.call(
            "apply", path, self._segment[1], placed, version, what=f"apply_weights(version {version})"
        )
        check_versions(served, version)
        yield {"bytes": sum(bucket_nbytes(b) for b in buckets), "buckets": len(buckets)}

    def close(self) -> None:
        """Remove this transport's segments: this process's, and any its sender made in a process
        that ended without closing (the driver closes its instance after the trainer actor is killed)."""
        self._segment = None
        self._cleanup()
        _unlink([str(p) for p in Path(self.params.directory).glob(f"relax-weights-{self.uid[:12]}-*")])


def _unlink(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
