"""Collective weight export across a trainer worker group.

A sharded trainer (tensor / pipeline / expert parallel) gathers its weights across ranks while it
exports them, so ``export_weights`` is a collective: every rank must iterate its own
``export_weights(bucket_bytes)`` in lockstep, and only rank 0 hands the buckets to a transport. A
trainer says so with a class attribute ``collective_export = True`` (see
``relax.core.protocols.Trainer``). Rank 0's ``TrainerRole`` then gives the transport the view below:
its ``export_weights`` has every peer drain the same export concurrently, under the role's fan-out
lock (no train step interleaves), with the worker group's failure handling (a failed peer is named
and the others are stopped instead of waiting in the collective forever).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from relax.core.controller.capabilities import declares

_END = object()
_PUT_POLL_S = 0.1


def is_collective(trainer: Any) -> bool:
    return declares(trainer, "collective_export")


def drain(trainer: Any, bucket_bytes: int) -> int:
    """A peer rank's share of a collective export: iterate it in step with rank 0, drop the buckets."""
    return sum(1 for _ in trainer.export_weights(bucket_bytes))


class CollectiveExport:
    """``trainer`` as rank 0's transports see it: every attribute is the trainer's, except that
    ``export_weights`` is run on all ranks of the group together (``peers``: ranks 1..)."""

    def __init__(self, trainer: Any, peers: Any, lock: threading.Lock) -> None:
        self._trainer, self._peers, self._lock = trainer, peers, lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[Any]:
        """Rank 0's buckets, one at a time (the export runs in a helper thread that holds the fan-out
        lock for the whole export). If the consumer stops early, rank 0 still finishes its share
        (dropping the rest) so that every rank leaves the collective together."""
        handoff: queue.Queue = queue.Queue(maxsize=1)
        stopped = threading.Event()

        def put(item: Any) -> None:
            while not stopped.is_set():
                try:
                    handoff.put(item, timeout=_PUT_POLL_S)
                    return
                except queue.Full:
                    continue

        def local() -> None:
            for bucket in self._trainer.export_weights(bucket_bytes):
                put(bucket)

        def run() -> None:
            try:
                with self._lock:
                    self._peers.run("drain_export", bucket_bytes, local=local)
                put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                put(exc)

        worker = threading.Thread(target=run, daemon=True, name="relax-collective-export")
        worker.start()
        try:
            while True:
                item = handoff.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stopped.set()
            worker.join()
