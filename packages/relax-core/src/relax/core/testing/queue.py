"""``QueueConformance``: the delivery rules of the queue contract (``relax.core.protocols.TransferQueueLike``).

Rows are keyed (partition, index); a consumer gets rows once they hold every requested column;
each consumer role has its own cursor; rows of a group arrive together; ``ack`` is final;
``put_rows`` blocks at capacity until every consumer acknowledged enough rows. Only what the
pipeline calls is checked: ``put_rows``, ``get``, ``add_columns``, ``ack``, ``metrics``, ``close``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from relax.core.protocols import TransferQueueLike


def rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"p{start + i}", "response": start + i} for i in range(n)]


def later(delay_s: float, fn: Callable[[], Any]) -> threading.Thread:
    """Run ``fn`` in a thread after ``delay_s``; join the thread to re-raise nothing (errors print)."""
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    thread.start()
    return thread


class QueueConformance:
    """Subclass as ``class TestMyQueue(QueueConformance)`` and implement ``make_queue``."""

    #: how long to wait for something that must happen
    wait_s: float = 10.0
    #: how long to wait for something that must not happen
    short_s: float = 0.2

    def make_queue(self, capacity: int, consumers: Sequence[str] = ()) -> TransferQueueLike:
        """The queue as the pipeline makes it: your factory called as ``factory(capacity=..., consumers=...)``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_queue(self, capacity, consumers)"
        )

    def close_queue(self, queue: Any) -> None:
        """Release what ``make_queue`` started. Default: ``queue.close()``, as the pipeline does."""
        queue.close()

    @contextmanager
    def queue(self, capacity: int, consumers: Sequence[str] = ()) -> Iterator[Any]:
        q = self.make_queue(capacity, consumers=list(consumers))
        try:
            yield q
        finally:
            self.close_queue(q)

    def test_is_a_transfer_queue(self):
        with self.queue(4) as q:
            assert isinstance(q, TransferQueueLike), f"{type(q).__name__} lacks TransferQueueLike methods"

    def test_put_rows_returns_keys_per_partition(self):
        with self.queue(8) as q:
            assert q.put_rows(0, rows(3)) == [(0, 0), (0, 1), (0, 2)]
            assert q.put_rows(0, rows(1, 3)) == [(0, 3)]
            assert q.put_rows(5, rows(2)) == [(5, 0), (5, 1)]

    def test_get_waits_for_columns_added_later(self):
        with self.queue(8, ["trainer"]) as q:
            keys = q.put_rows(0, rows(2), version=3)
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response", "reward"], batch_size=2, timeout=self.short_s)
            adder = later(self.short_s, lambda: q.add_columns(keys, {"reward": [1.0, -1.0]}))
            batch = q.get("trainer", ["response", "reward"], batch_size=2, timeout=self.wait_s)
            adder.join()
            assert [tuple(k) for k in batch.keys] == keys
            assert batch.data == {"response": [0, 1], "reward": [1.0, -1.0]}, (
                "only the requested columns, in key order"
            )
            assert [tuple(v) for v in batch.versions] == [(3, 3), (3, 3)]

    def test_consumers_have_independent_cursors(self):
        with self.queue(8, ["trainer", "ref"]) as q:
            q.put_rows(0, rows(4))
            first = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            ref = q.get("ref", ["response"], batch_size=4, timeout=self.wait_s)
            second = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            assert first.data["response"] == [0, 1] and second.data["response"] == [2, 3]
            assert ref.data["response"] == [0, 1, 2, 3], "another consumer's reads must not move this cursor"

    def test_ack_is_final(self):
        with self.queue(2, ["trainer"]) as q:
            q.put_rows(0, rows(2))
            batch = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            q.ack("trainer", batch.keys)
            q.ack("trainer", batch.keys)  # idempotent
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s)
            keys = q.put_rows(0, rows(2, 2), timeout=self.wait_s)  # TimeoutError: acked rows kept their room
            assert keys == [(0, 2), (0, 3)], "rows every consumer acknowledged are evicted and free capacity"
            again = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            assert again.data["response"] == [2, 3], "acknowledged rows are never handed out again"

    def test_capacity_backpressure_until_every_consumer_acked(self):
        with self.queue(4, ["trainer", "ref"]) as q:
            q.put_rows(0, rows(4))
            with pytest.raises(ValueError):
                q.put_rows(0, rows(5))  # can never fit
            with pytest.raises(TimeoutError):
                q.put_rows(0, rows(1), timeout=self.short_s)
            got = q.get("trainer", ["response"], batch_size=4, timeout=self.wait_s)
            q.ack("trainer", got.keys)
            with pytest.raises(TimeoutError):  # "ref" has not seen them: they must stay
                q.put_rows(0, rows(1), timeout=self.short_s)

            def ref_consumes() -> None:
                batch = q.get("ref", ["response"], batch_size=2, timeout=self.wait_s)
                q.ack("ref", batch.keys)

            consumer = later(self.short_s, ref_consumes)
            assert q.put_rows(0, rows(2, 4), timeout=self.wait_s) == [(0, 4), (0, 5)]
            consumer.join()
            rest = q.get("ref", ["response"], batch_size=4, timeout=self.wait_s)
            assert rest.data["response"] == [2, 3, 4, 5]

    def test_handed_out_rows_are_not_handed_out_again(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(4))
            first = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            second = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s)
            assert first.data["response"] == [0, 1] and second.data["response"] == [2, 3], (
                "a row handed to a consumer (acknowledged or not) is not handed to it again"
            )
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s)

    def test_metrics_count_rows(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(3))
            m = q.metrics()
            assert m["queue/rows"] == 3 and m["queue/capacity"] == 8, f"queue/rows, queue/capacity: {m}"
            q.ack("trainer", q.get("trainer", ["response"], batch_size=3, timeout=self.wait_s).keys)
            assert q.metrics()["queue/rows"] == 0, "rows every consumer acknowledged are evicted"

    def test_group_aware_batches_hold_whole_groups(self):
        with self.queue(16, ["trainer"]) as q:
            q.put_rows(0, rows(3), group_ids=["a"] * 3)
            q.put_rows(0, rows(2, 3), group_ids=["b"] * 2)
            q.put_rows(1, rows(2, 5), group_ids=["c"] * 2)
            with pytest.raises(TimeoutError):  # a batch is whole groups: 3 + 2 + 2 cannot make 4
                q.get("trainer", ["response"], batch_size=4, timeout=self.short_s)
            batch = q.get("trainer", ["response"], batch_size=5, timeout=self.wait_s)
            assert batch.group_ids == ["a", "a", "a", "b", "b"] and batch.data["response"] == [0, 1, 2, 3, 4]
            assert q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s).data["response"] == [
                5,
                6,
            ]

    def test_partition_filter(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(2))
            q.put_rows(1, rows(2, 2))
            one = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, partition=1)
            assert one.data["response"] == [2, 3], "partition=1 must hand out only that partition's rows"
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s, partition=1)
            zero = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, partition=0)
            assert zero.data["response"] == [0, 1]
