"""Both built-in transfer queues (in-process and Ray actor) pass the queue suite, and each seeded
fault in a queue makes the named check fail (with the compared values in its message)."""

import pytest

from relax.core.queue import TransferQueue, TransferQueueClient
from relax.core.testing.queue import QueueConformance


class TestLocalQueueConformance(QueueConformance):
    def make_queue(self, capacity, consumers=()):
        return TransferQueue(capacity, consumers=consumers)


class TestRayQueueConformance(QueueConformance):
    @pytest.fixture(autouse=True)
    def _ray(self, ray_local):
        return ray_local

    def make_queue(self, capacity, consumers=()):
        return TransferQueueClient.create(capacity, consumers=consumers)


# ------------------------------------------------------------------ seeded faults
class FaultyQueue(TransferQueue):
    fault = "none"

    def __init__(self, capacity, consumers=()):
        super().__init__(1000 if self.fault == "no_backpressure" else capacity, consumers)

    def get(self, consumer, *args, **kw):
        if self.fault == "redelivers":
            self.release(consumer)  # forgets what it handed out
        return super().get("shared" if self.fault == "shared_cursor" else consumer, *args, **kw)

    def ack(self, consumer, keys):
        if self.fault != "noop_ack":
            super().ack("shared" if self.fault == "shared_cursor" else consumer, keys)

    def metrics(self):
        return {**super().metrics(), "queue/rows": 0} if self.fault == "no_row_count" else super().metrics()


class QueueSuite(QueueConformance):
    wait_s = 1.0  # a faulty queue often never delivers: fail fast
    short_s = 0.1
    fault = "none"

    def make_queue(self, capacity, consumers=()):
        cls = type("Q", (FaultyQueue,), {"fault": self.fault})
        return cls(capacity, consumers)


@pytest.mark.parametrize(
    ("test_name", "fault"),
    [
        ("test_ack_is_final", "noop_ack"),
        ("test_handed_out_rows_are_not_handed_out_again", "redelivers"),
        ("test_capacity_backpressure_until_every_consumer_acked", "no_backpressure"),
        ("test_consumers_have_independent_cursors", "shared_cursor"),
        ("test_metrics_count_rows", "no_row_count"),
    ],
)
def test_queue_suite_catches(test_name, fault):
    suite = QueueSuite()
    suite.fault = fault
    with pytest.raises((AssertionError, pytest.fail.Exception, TimeoutError)):
        getattr(suite, test_name)()


def test_queue_suite_passes_the_unfaulted_queue():
    suite = QueueSuite()
    for name in [n for n in dir(QueueConformance) if n.startswith("test_")]:
        getattr(suite, name)()


def test_kit_failures_show_the_values_compared():
    """``pytest.register_assert_rewrite`` of ``relax.core.testing``: a bare ``assert a == b`` in the
    kit reports both sides, as in the user's own test files."""
    import relax.core.testing.queue as kit_queue

    assert type(kit_queue.__loader__).__name__ == "AssertionRewritingHook", "the kit is not assert-rewritten"
    suite = QueueSuite()
    suite.fault = "redelivers"
    with pytest.raises(AssertionError) as err:
        suite.test_handed_out_rows_are_not_handed_out_again()
    assert "[0, 1] == [2, 3]" in str(err.value), (
        f"no compared values in: {err.value}"
    )  # 2nd batch repeats the 1st
