"""``QueueConformance``: the transfer-queue delivery rules every ``TransferQueueLike`` keeps.

Rows are keyed (partition, index); a consumer gets rows once they hold every requested column;
each consumer role has its own cursor; ``ack`` is final; ``put_rows`` blocks at capacity until
every consumer acknowledged enough rows; unacknowledged rows come back after ``release`` (a
consumer restart), lease expiry or a ``state_dict`` restore.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from relax.core.queue import TransferQueueLike


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

    def make_queue(
        self, capacity: int, consumers: Sequence[str] = (), lease_timeout_s: float | None = None
    ) -> TransferQueueLike:
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_queue(self, capacity, consumers, lease_timeout_s)"
        )

    def close_queue(self, queue: Any) -> None:
        """Release what ``make_queue`` started (e.g. kill an actor). Default: nothing."""

    @contextmanager
    def queue(
        self, capacity: int, consumers: Sequence[str] = (), lease_timeout_s: float | None = None
    ) -> Iterator[Any]:
        q = self.make_queue(capacity, consumers=list(consumers), lease_timeout_s=lease_timeout_s)
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
            first = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            ref = q.get("ref", ["response"], batch_size=4, timeout=self.wait_s, group_aware=False)
            second = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            assert first.data["response"] == [0, 1] and second.data["response"] == [2, 3]
            assert ref.data["response"] == [0, 1, 2, 3], "another consumer's reads must not move this cursor"

    def test_ack_is_final(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(2))
            batch = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            q.ack("trainer", batch.keys)
            q.ack("trainer", batch.keys)  # idempotent
            assert q.release("trainer") == 0, "acknowledged rows are not leased"
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s)

    def test_capacity_backpressure_until_every_consumer_acked(self):
        with self.queue(4, ["trainer", "ref"]) as q:
            q.put_rows(0, rows(4))
            with pytest.raises(ValueError):
                q.put_rows(0, rows(5))  # can never fit
            with pytest.raises(TimeoutError):
                q.put_rows(0, rows(1), timeout=self.short_s)
            got = q.get("trainer", ["response"], batch_size=4, timeout=self.wait_s, group_aware=False)
            q.ack("trainer", got.keys)
            with pytest.raises(TimeoutError):  # "ref" has not seen them: they must stay
                q.put_rows(0, rows(1), timeout=self.short_s)

            def ref_consumes() -> None:
                batch = q.get("ref", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
                q.ack("ref", batch.keys)

            consumer = later(self.short_s, ref_consumes)
            assert q.put_rows(0, rows(2, 4), timeout=self.wait_s) == [(0, 4), (0, 5)]
            consumer.join()
            rest = q.get("ref", ["response"], batch_size=4, timeout=self.wait_s, group_aware=False)
            assert rest.data["response"] == [2, 3, 4, 5]

    def test_unacked_rows_are_redelivered_after_release(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(4))
            first = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            second = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            q.ack("trainer", first.keys)
            assert q.release("trainer") == 2, "release() returns how many leased rows it freed"
            again = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            assert [tuple(k) for k in again.keys] == [tuple(k) for k in second.keys]
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s)

    def test_expired_leases_are_redelivered(self):
        with self.queue(8, ["trainer"], lease_timeout_s=0.3) as q:
            q.put_rows(0, rows(2))
            first = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            again = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            assert [tuple(k) for k in again.keys] == [tuple(k) for k in first.keys]

    def test_state_dict_restores_unacked_rows(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(4), version=2)
            done = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False)
            q.ack("trainer", done.keys)
            q.get(
                "trainer", ["response"], batch_size=1, timeout=self.wait_s, group_aware=False
            )  # leased, lost
            state = q.state_dict()
        with self.queue(8, ["trainer"]) as restored:
            restored.load_state_dict(state)
            batch = restored.get(
                "trainer", ["response"], batch_size=2, timeout=self.wait_s, group_aware=False
            )
            assert batch.data["response"] == [2, 3] and [tuple(v) for v in batch.versions] == [(2, 2)] * 2
            with pytest.raises(TimeoutError):
                restored.get("trainer", ["response"], batch_size=1, timeout=self.short_s)
            assert restored.put_rows(0, rows(1)) == [(0, 4)], "the partition's next index is restored"

    def test_group_aware_batches_hold_whole_groups(self):
        with self.queue(16, ["trainer"]) as q:
            q.put_rows(0, rows(3), group_ids=["a"] * 3)
            q.put_rows(0, rows(2, 3), group_ids=["b"] * 2)
            q.put_rows(1, rows(1, 5), group_ids=["c"], group_size=2)  # c is still being produced
            batch = q.get("trainer", ["response"], batch_size=5, timeout=self.wait_s)
            assert batch.group_ids == ["a", "a", "a", "b", "b"] and batch.data["response"] == [0, 1, 2, 3, 4]
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=2, timeout=self.short_s)
            q.put_rows(1, rows(1, 6), group_ids=["c"], group_size=2)
            assert q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s).data["response"] == [
                5,
                6,
            ]

    def test_partition_filter_and_clear_partition(self):
        with self.queue(8, ["trainer"]) as q:
            q.put_rows(0, rows(2))
            q.put_rows(1, rows(2, 2))
            one = q.get("trainer", ["response"], batch_size=2, timeout=self.wait_s, partition=1)
            assert one.data["response"] == [2, 3], "partition=1 must hand out only that partition's rows"
            assert q.clear_partition(0) == 2
            with pytest.raises(TimeoutError):
                q.get("trainer", ["response"], batch_size=1, timeout=self.short_s)
            assert q.put_rows(0, rows(6)) == [(0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7)], (
                "cleared rows free capacity; indices keep counting"
            )
