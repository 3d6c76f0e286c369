"""Transfer queue: the data plane between rollout, reward/reference/advantage roles and the trainer.

Two implementations of one contract (``relax.core.protocols.TransferQueueLike``, re-exported here):
``"local"`` — the in-process, thread-safe :class:`TransferQueue`; ``"ray"`` — the same class as a
shared Ray actor behind a :class:`TransferQueueClient` (payloads through the object store). The
pipeline calls a factory as ``factory(capacity=..., consumers=[...])``; these two also take
``lease_timeout_s`` and the Ray one ``inline_bytes`` and ``name`` (features outside the contract).
"""

from __future__ import annotations

from typing import Any

from relax.core.protocols import Batch, Key, TransferQueueLike, VersionSpec
from relax.core.queue.core import TransferQueue
from relax.core.queue.ray_queue import TransferQueueActor, TransferQueueClient


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
    "VersionSpec",
    "local_queue",
    "ray_queue",
    "register_builtin_queues",
]
