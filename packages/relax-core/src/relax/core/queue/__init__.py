"""Transfer queue: the data plane between rollout, reward/reference/advantage roles and the trainer.

Two implementations with one interface (:class:`TransferQueueLike`): ``"local"`` — the in-process,
thread-safe :class:`TransferQueue`; ``"ray"`` — the same class as a shared Ray actor behind a
:class:`TransferQueueClient` (payloads through the object store). Factories take
``(capacity, **kw)``: ``consumers``, ``lease_timeout_s``; the Ray one also ``inline_bytes``, ``name``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from relax.core.queue.core import Batch, Key, TransferQueue, VersionSpec
from relax.core.queue.ray_queue import TransferQueueActor, TransferQueueClient


@runtime_checkable
class TransferQueueLike(Protocol):
    def put_rows(
        self,
        partition: int,
        rows: Sequence[dict[str, Any]],
        group_ids: Sequence[Any] | None = None,
        version: VersionSpec | list[VersionSpec] = 0,
        group_size: int | None = None,
        timeout: float | None = None,
    ) -> list[Key]: ...

    def add_columns(self, keys: Sequence[Key], columns: dict[str, Sequence[Any]]) -> None: ...

    def register_consumer(self, consumer: str) -> None: ...

    def get(
        self,
        consumer: str,
        columns: Sequence[str],
        batch_size: int,
        timeout: float | None,
        group_aware: bool = True,
        partition: int | None = None,
    ) -> Batch: ...

    def ack(self, consumer: str, keys: Iterable[Key]) -> None: ...

    def release(self, consumer: str) -> int: ...

    def clear_partition(self, partition: int) -> int: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def local_queue(capacity: int, **kw: Any) -> TransferQueue:
    """Factory registered as queue ``"local"``."""
    return TransferQueue(capacity, **kw)


def ray_queue(capacity: int, **kw: Any) -> TransferQueueClient:
    """Factory registered as queue ``"ray"`` (needs ``ray.init`` first)."""
    return TransferQueueClient.create(capacity, **kw)


def register_builtin_queues(register) -> None:
    """Called from ``relax.core.builtin``'s ``relax_register_queues`` hook."""
    register("local", local_queue)
    register("ray", ray_queue)


__all__ = [
    "Batch",
    "Key",
    "TransferQueue",
    "TransferQueueActor",
    "TransferQueueClient",
    "TransferQueueLike",
    "local_queue",
    "ray_queue",
    "register_builtin_queues",
]
