"""The in-process TransferQueue: delivery, groups, backpressure, leases, eviction, checkpoints, fuzz."""

from __future__ import annotations

import random
import threading
import time

import pytest

from relax.core.queue import Batch, TransferQueue, TransferQueueLike


def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"p{start + i}", "response": start + i} for i in range(n)]


def test_get_waits_for_columns_added_later():
    q = TransferQueue(capacity=8, consumers=["trainer"])
    keys = q.put_rows(0, _rows(2), version=3)
    assert keys == [(0, 0), (0, 1)]

    def late_reward():
        time.sleep(0.1)
        q.add_columns(keys, {"reward": [1.0, -1.0]})

    threading.Thread(target=late_reward).start()
    start = time.monotonic()
    batch = q.get("trainer", ["response", "reward"], batch_size=2, timeout=5)
    assert time.monotonic() - start >= 0.09
    assert batch.keys == keys
    assert batch.data == {"response": [0, 1], "reward": [1.0, -1.0]}
    assert batch.versions == [(3, 3), (3, 3)] and batch.min_version == batch.max_version == 3


def test_timeout_names_consumer_and_missing_columns():
    q = TransferQueue(capacity=4)
    q.put_rows(0, _rows(3))
    with pytest.raises(
        TimeoutError, match=r"consumer 'ref'.*\['response', 'ref_logprobs'\].*ref_logprobs': 3"
    ):
        q.get("ref", ["response", "ref_logprobs"], batch_size=2, timeout=0.05)


def test_group_aware_batches_keep_whole_groups_in_order():
    q = TransferQueue(capacity=16, consumers=["trainer"])
    q.put_rows(0, _rows(3), group_ids=["a", "a", "a"])
    q.put_rows(0, _rows(2, 3), group_ids=["b", "b"])
    q.put_rows(1, _rows(2, 5), group_ids=["c", "c"])
    # first fit in arrival order: a (3) then b does not fit into 4, c does not either; wait -> timeout
    with pytest.raises(TimeoutError):
        q.get("trainer", ["response"], batch_size=4, timeout=0.05)
    batch = q.get("trainer", ["response"], batch_size=5, timeout=1)
    assert batch.keys == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert batch.group_ids == ["a", "a", "a", "b", "b"]
    with pytest.raises(ValueError, match="more than batch_size"):
        q.get("other", ["response"], batch_size=2, timeout=1)
    flat = q.get("other", ["response"], batch_size=2, timeout=1, group_aware=False)
    assert flat.keys == [(0, 0), (0, 1)]


def test_group_streamed_over_several_puts_waits_until_complete():
    q = TransferQueue(capacity=8)
    q.put_rows(2, _rows(1), group_ids=["g"], group_size=3)
    q.put_rows(2, _rows(1, 1), group_ids=["g"], group_size=3)
    with pytest.raises(TimeoutError):
        q.get("trainer", ["response"], batch_size=3, timeout=0.05)
    q.put_rows(2, _rows(1, 2), group_ids=["g"], group_size=3)
    assert q.get("trainer", ["response"], batch_size=3, timeout=1).data["response"] == [0, 1, 2]
    with pytest.raises(ValueError, match="group_size 3"):
        q.put_rows(2, _rows(1), group_ids=["g"], group_size=3)
    with pytest.raises(ValueError, match="already complete"):
        q.put_rows(3, _rows(1), group_ids=["h"])
        q.put_rows(3, _rows(1), group_ids=["h"])


def test_backpressure_blocks_put_until_rows_are_acked():
    q = TransferQueue(capacity=4, consumers=["trainer"])
    q.put_rows(0, _rows(4))
    with pytest.raises(TimeoutError, match=r"full.*4/4.*'trainer': 4"):
        q.put_rows(0, _rows(1), timeout=0.05)
    with pytest.raises(ValueError, match="capacity 4"):
        q.put_rows(0, _rows(5))

    def consume():
        time.sleep(0.1)
        batch = q.get("trainer", ["response"], batch_size=2, timeout=1)
        q.ack("trainer", batch.keys)

    threading.Thread(target=consume).start()
    assert q.put_rows(0, _rows(2), timeout=5) == [(0, 4), (0, 5)]
    assert q.metrics()["queue/rows"] == 4


def test_release_and_lease_expiry_redeliver_but_ack_is_final():
    q = TransferQueue(capacity=8, consumers=["trainer"], lease_timeout_s=0.2)
    q.put_rows(0, _rows(4))
    first = q.get("trainer", ["response"], batch_size=2, timeout=1, group_aware=False)
    second = q.get("trainer", ["response"], batch_size=2, timeout=1, group_aware=False)
    assert first.keys == [(0, 0), (0, 1)] and second.keys == [(0, 2), (0, 3)]
    q.ack("trainer", first.keys)
    assert q.release("trainer") == 2  # the worker holding `second` died
    again = q.get("trainer", ["response"], batch_size=2, timeout=1, group_aware=False)
    assert again.keys == second.keys
    start = time.monotonic()  # never acked: the lease runs out and the rows come back
    expired = q.get("trainer", ["response"], batch_size=2, timeout=2, group_aware=False)
    assert (
        expired.keys == second.keys and 0.15 < time.monotonic() - start
    )  # after the lease, within get's timeout
    q.ack("trainer", expired.keys)
    with pytest.raises(TimeoutError):
        q.get("trainer", ["response"], batch_size=1, timeout=0.3)


def test_eviction_after_every_consumer_acked_and_clear_partition():
    q = TransferQueue(capacity=8, consumers=["trainer", "ref"])
    keys = q.put_rows(0, _rows(2))
    q.put_rows(1, _rows(3))
    q.ack("trainer", keys)
    assert q.metrics()["queue/rows"] == 5
    q.ack("ref", keys)
    q.ack("ref", keys)  # idempotent
    m = q.metrics()
    assert m["queue/rows"] == 3 and m["queue/rows_consumed/ref"] == 2
    assert q.clear_partition(1) == 3 and q.metrics()["queue/rows"] == 0
    with pytest.raises(KeyError, match="not in the transfer queue"):
        q.add_columns(keys, {"reward": [0.0, 0.0]})


def test_metrics_depth_per_column_and_counters():
    q = TransferQueue(capacity=8, consumers=["trainer"])
    keys = q.put_rows(0, _rows(3))
    q.add_columns(keys[:2], {"reward": [1.0, 0.0]})
    batch = q.get("trainer", ["reward"], batch_size=2, timeout=1)
    m = q.metrics()
    assert m["queue/depth/prompt"] == 3 and m["queue/depth/reward"] == 2
    assert m["queue/rows_produced"] == 3 and m["queue/leased/trainer"] == 2
    q.ack("trainer", batch.keys)
    assert q.metrics()["queue/rows_consumed/trainer"] == 2 and q.metrics()["queue/wait_s/trainer"] >= 0


def test_state_dict_roundtrip_turns_unacked_rows_into_pending():
    q = TransferQueue(capacity=16, consumers=["trainer", "ref"])
    q.put_rows(0, _rows(4), group_ids=["a", "a", "b", "b"], version=[1, 1, (1, 2), (1, 2)])
    q.put_rows(1, _rows(2, 4), group_ids=["c", "c"], version=2)
    done = q.get("trainer", ["response"], batch_size=2, timeout=1)  # group a
    q.ack("trainer", done.keys)
    q.ack("ref", done.keys)  # group a fully consumed -> evicted
    inflight = q.get("trainer", ["response"], batch_size=2, timeout=1)  # group b, never acked
    ref_done = q.get("ref", ["response"], batch_size=2, timeout=1)
    q.ack("ref", ref_done.keys)
    state = q.state_dict()

    restored = TransferQueue(capacity=16)
    restored.load_state_dict(state)
    again = restored.get("trainer", ["response"], batch_size=4, timeout=1)
    assert again.keys == inflight.keys + [(1, 0), (1, 1)]
    assert again.versions == [(1, 2), (1, 2), (2, 2), (2, 2)]
    ref_next = restored.get("ref", ["response"], batch_size=2, timeout=1)
    assert ref_next.keys == [(1, 0), (1, 1)]  # ref already acked group b
    assert restored.put_rows(0, _rows(1)) == [(0, 4)]  # index continues
    assert restored.metrics()["queue/rows_produced"] == 7


def test_protocol_is_satisfied():
    assert isinstance(TransferQueue(1), TransferQueueLike)


def _check_batch_groups(batch: Batch) -> None:
    """Every group in a batch is contiguous and in index order."""
    seen: set = set()
    for i, (key, gid) in enumerate(zip(batch.keys, batch.group_ids, strict=True)):
        g = (key[0], gid)
        if i and g == (batch.keys[i - 1][0], batch.group_ids[i - 1]):
            assert key[1] > batch.keys[i - 1][1]
        else:
            assert g not in seen
            seen.add(g)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fuzz_concurrent_producers_and_consumers_exactly_once(seed):
    """3 producers, a reward role adding a column, 2 trainer workers, a crash-prone ref role."""
    rng = random.Random(seed)
    group, partitions, groups_per_partition, capacity = 4, 6, 5, 24
    total = partitions * groups_per_partition * group
    q = TransferQueue(capacity=capacity, consumers=["reward", "trainer", "ref"])
    acked: dict[str, list] = {"reward": [], "trainer": [], "ref": []}
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()
    sleeps = {name: random.Random(rng.random()) for name in ("p0", "p1", "p2", "reward", "t0", "t1", "ref")}

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as exc:  # surface thread failures in the test
                errors.append(exc)
                stop.set()

        return run

    def produce(pid: int):
        r = sleeps[f"p{pid}"]
        for part in range(pid, partitions, 3):
            for g in range(groups_per_partition):
                time.sleep(r.random() * 0.002)
                rows = [{"response": (part, g, s)} for s in range(group)]
                q.put_rows(part, rows, group_ids=[g] * group, version=part, timeout=10)

    def consume(role: str, name: str, columns: list[str], crash_p: float, add_reward: bool):
        r = sleeps[name]
        while not stop.is_set():
            with lock:
                if len(acked[role]) >= total:
                    return
            try:
                batch = q.get(role, columns, batch_size=2 * group, timeout=0.05)
            except TimeoutError:
                continue
            _check_batch_groups(batch)
            assert all(resp[0] == k[0] for resp, k in zip(batch.data["response"], batch.keys, strict=True))
            time.sleep(r.random() * 0.002)
            if r.random() < crash_p:
                q.release(role)  # worker died before acking: its rows must come back
                continue
            if add_reward:
                q.add_columns(batch.keys, {"reward": [float(resp[2]) for resp in batch.data["response"]]})
            with lock:
                acked[role].extend(batch.keys)
            q.ack(role, batch.keys)

    threads = [threading.Thread(target=guarded(produce), args=(p,)) for p in range(3)]
    threads += [
        threading.Thread(target=guarded(consume), args=("reward", "reward", ["response"], 0.0, True)),
        threading.Thread(target=guarded(consume), args=("trainer", "t0", ["response", "reward"], 0.0, False)),
        threading.Thread(target=guarded(consume), args=("trainer", "t1", ["response", "reward"], 0.0, False)),
        threading.Thread(target=guarded(consume), args=("ref", "ref", ["response"], 0.3, False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    all_keys = sorted((p, i) for p in range(partitions) for i in range(groups_per_partition * group))
    for role, keys in acked.items():
        assert sorted(keys) == all_keys, role  # every row exactly once per role
    m = q.metrics()
    assert m["queue/max_rows"] <= capacity and m["queue/rows"] == 0
    assert m["queue/rows_produced"] == total


def test_partition_filter_takes_one_step_only():
    q = TransferQueue(capacity=16, consumers=["trainer"])
    q.put_rows(2, [{"x": 20}, {"x": 21}], group_ids=["b", "b"])  # step 2 arrives first
    q.put_rows(1, [{"x": 10}, {"x": 11}], group_ids=["a", "a"])
    with pytest.raises(TimeoutError):
        q.get("trainer", ["x"], 4, timeout=0.05, partition=1)  # only 2 rows of step 1 exist
    batch = q.get("trainer", ["x"], 2, timeout=0.05, partition=1)
    assert batch.data["x"] == [10, 11] and all(k[0] == 1 for k in batch.keys)
    assert q.get("trainer", ["x"], 2, timeout=0.05, partition=2).data["x"] == [20, 21]
