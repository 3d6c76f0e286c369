"""Both built-in transfer queues (in-process and Ray actor) pass the queue suite."""

import pytest
import ray

from relax.core.queue import TransferQueue, TransferQueueClient
from relax.core.testing.queue import QueueConformance


class TestLocalQueueConformance(QueueConformance):
    def make_queue(self, capacity, consumers=(), lease_timeout_s=None):
        return TransferQueue(capacity, consumers=consumers, lease_timeout_s=lease_timeout_s)


class TestRayQueueConformance(QueueConformance):
    @pytest.fixture(autouse=True)
    def _ray(self, ray_local):
        return ray_local

    def make_queue(self, capacity, consumers=(), lease_timeout_s=None):
        return TransferQueueClient.create(capacity, consumers=consumers, lease_timeout_s=lease_timeout_s)

    def close_queue(self, queue):
        ray.kill(queue.actor)
