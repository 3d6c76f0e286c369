"""The transfer queue as a Ray actor: object-store payloads, cross-process roles, crashes, checkpoints."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import ray
import torch

from relax.core.queue import TransferQueueClient, TransferQueueLike, ray_queue

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0)
class Role:
    """A producer or consumer process; holds the batch it is working on until told to ack."""

    def __init__(self, client: TransferQueueClient):
        self.client = client
        self.batch = None

    def produce(self, partitions: list[int], groups: int, group: int, seed: int) -> int:
        rng = random.Random(seed)
        for part in partitions:
            for g in range(groups):
                time.sleep(rng.random() * 0.003)
                rows = [
                    {"response": (part, g, s), "logits": torch.full((8,), float(s))} for s in range(group)
                ]
                self.client.put_rows(part, rows, group_ids=[g] * group, version=part, timeout=30)
        return len(partitions) * groups * group

    def consume(self, role: str, columns: list[str], batch_size: int, total: int, seed: int) -> list:
        """Consume until ``total`` rows were acked; returns the acked batches' (keys, group ids)."""
        rng = random.Random(seed)
        batches, n = [], 0
        while n < total:
            batch = self.client.get(role, columns, batch_size, timeout=30)
            time.sleep(rng.random() * 0.003)
            if rng.random() < 0.25:
                self.client.release(role)  # simulated crash + restart: these rows must come back
                continue
            self.client.ack(role, batch.keys)
            batches.append((batch.keys, batch.group_ids))
            n += len(batch.keys)
        return batches

    def take(self, role: str, batch_size: int) -> list:
        self.batch = self.client.get(role, ["payload"], batch_size, timeout=30)
        return self.batch.keys


def test_tensors_travel_as_object_refs_and_metadata_inline(ray_local):
    client = ray_queue(8, consumers=["trainer"], inline_bytes=1 << 10)
    assert isinstance(client, TransferQueueLike)
    big = torch.randn(256, 1024)  # 1 MiB
    keys = client.put_rows(0, [{"prompt": "hi", "small": torch.ones(4), "big": big}], version=(2, 3))
    held = ray.get(client.actor.state_dict.remote())["rows"][0]["columns"]
    assert isinstance(held["big"], ray.ObjectRef)
    assert held["prompt"] == "hi" and not isinstance(held["small"], ray.ObjectRef)  # inline
    client.add_columns(keys, {"ref_logprobs": [torch.arange(1024.0)]})
    batch = client.get("trainer", ["big", "small", "ref_logprobs"], batch_size=1, timeout=5)
    assert torch.equal(batch.data["big"][0], big) and torch.equal(batch.data["small"][0], torch.ones(4))
    assert torch.equal(batch.data["ref_logprobs"][0], torch.arange(1024.0))
    assert batch.versions == [(2, 3)]
    with pytest.raises(TimeoutError, match=r"consumer 'trainer' waited 0.1s.*\['big'\]"):
        client.get("trainer", ["big"], batch_size=1, timeout=0.1)
    with pytest.raises(KeyError, match="not in the transfer queue"):
        client.add_columns([(5, 5)], {"x": [1]})
    ray.kill(client.actor)


def test_cross_process_producers_and_consumers_exactly_once(ray_local):
    """Two producer processes + driver-thread producer, a consumer process with crashes, a driver consumer."""
    group, groups, capacity = 3, 4, 12
    client = TransferQueueClient.create(capacity, consumers=["trainer", "ref"])
    producers = [Role.remote(client) for _ in range(2)]
    consumer = Role.remote(client)
    total = 6 * groups * group
    futs = [
        producers[0].produce.remote([0, 3], groups, group, 1),
        producers[1].produce.remote([1, 4], groups, group, 2),
    ]
    futs.append(consumer.consume.remote("trainer", ["response", "logits"], 2 * group, total, 3))
    driver_err: list[BaseException] = []

    def drive():
        try:
            for part in (2, 5):
                for g in range(groups):
                    rows = [
                        {"response": (part, g, s), "logits": torch.full((8,), float(s))} for s in range(group)
                    ]
                    client.put_rows(part, rows, group_ids=[g] * group, version=part, timeout=30)
        except BaseException as exc:
            driver_err.append(exc)

    producer_thread = threading.Thread(target=drive)
    producer_thread.start()
    ref_keys = []
    while len(ref_keys) < total:
        batch = client.get("ref", ["response"], batch_size=group, timeout=30)
        assert [r[2] for r in batch.data["response"]] == list(range(group))  # order within group
        ref_keys += batch.keys
        client.ack("ref", batch.keys)
        assert client.metrics()["queue/rows"] <= capacity
    producer_thread.join(timeout=30)
    assert not driver_err
    produced = ray.get(futs[:2], timeout=60)
    trainer_batches = ray.get(futs[2], timeout=60)
    trainer_keys = [k for keys, _ in trainer_batches for k in keys]
    expected = sorted((p, i) for p in range(6) for i in range(groups * group))
    assert sum(produced) == 2 * total // 3
    assert sorted(ref_keys) == expected and sorted(trainer_keys) == expected
    for keys, gids in trainer_batches:  # whole groups, each contiguous and in index order
        for start in range(0, len(keys), group):
            assert len(set(gids[start : start + group])) == 1
            assert [k[1] for k in keys[start : start + group]] == list(
                range(keys[start][1], keys[start][1] + group)
            )
    m = client.metrics()
    assert m["queue/max_rows"] <= capacity and m["queue/rows"] == 0 and m["queue/rows_produced"] == total
    for actor in [*producers, consumer, client.actor]:
        ray.kill(actor)


@pytest.mark.parametrize("how", ["release", "lease_timeout"])
def test_killed_consumer_rows_are_redelivered(ray_local, how):
    client = TransferQueueClient.create(
        8, consumers=["trainer"], lease_timeout_s=1.0 if how == "lease_timeout" else None
    )
    payloads = [torch.randn(64 << 8) for _ in range(4)]  # 64 KiB each: through the object store
    client.put_rows(0, [{"payload": p} for p in payloads])
    doomed = Role.remote(client)
    assert ray.get(doomed.take.remote("trainer", 2), timeout=60) == [(0, 0), (0, 1)]
    ray.kill(doomed)
    if how == "release":
        assert client.release("trainer") == 2
    start = time.monotonic()
    batch = client.get("trainer", ["payload"], batch_size=4, timeout=10, group_aware=False)
    assert sorted(batch.keys) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    if how == "lease_timeout":
        assert time.monotonic() - start > 0.5
    for key, value in zip(batch.keys, batch.data["payload"], strict=True):
        assert torch.equal(value, payloads[key[1]])
    client.ack("trainer", batch.keys)
    assert client.metrics()["queue/rows"] == 0
    ray.kill(client.actor)


def test_checkpoint_restore_through_client(ray_local):
    client = TransferQueueClient.create(8, consumers=["trainer"], inline_bytes=1024)
    data = [torch.randn(1024) for _ in range(4)]
    client.put_rows(3, [{"payload": d} for d in data], group_ids=["a", "a", "b", "b"], version=7)
    done = client.get("trainer", ["payload"], batch_size=2, timeout=5)
    client.ack("trainer", done.keys)
    client.get("trainer", ["payload"], batch_size=2, timeout=5)  # in flight when the checkpoint is taken
    state = client.state_dict()
    assert all(isinstance(r["columns"]["payload"], torch.Tensor) for r in state["rows"])
    ray.kill(client.actor)

    restored = TransferQueueClient.create(8, inline_bytes=1024)
    restored.load_state_dict(state)
    assert isinstance(
        ray.get(restored.actor.state_dict.remote())["rows"][0]["columns"]["payload"], ray.ObjectRef
    )
    batch = restored.get("trainer", ["payload"], batch_size=2, timeout=5)
    assert batch.keys == [(3, 2), (3, 3)] and batch.versions == [(7, 7)] * 2
    assert all(torch.equal(a, b) for a, b in zip(batch.data["payload"], data[2:], strict=True))
    ray.kill(restored.actor)


def test_small_tensors_round_trip_inline_with_dtype_and_values(ray_local):
    client = TransferQueueClient.create(capacity=8, consumers=["c"])
    values = [
        torch.arange(6, dtype=torch.int64),
        torch.randn(3, 4),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor(True),
    ]
    client.put_rows(1, [{"t": v} for v in values])
    got = client.get("c", ["t"], 4, timeout=10, group_aware=False).data["t"]
    for sent, received in zip(values, got, strict=True):
        assert (
            isinstance(received, torch.Tensor)
            and received.dtype == sent.dtype
            and torch.equal(received, sent)
        )


def test_get_acks_the_previous_batch_and_any_part_count_decodes(ray_local):
    """A get carries the previous batch's ack; the client's guess of how many blob parts a batch
    needs comes from the last batch, so a jump in row size must still decode exactly."""
    client = TransferQueueClient.create(capacity=600, consumers=["c"])
    client.put_rows(0, [{"x": torch.arange(4)} for _ in range(4)])
    first = client.get("c", ["x"], 4, timeout=10, group_aware=False)
    big = [torch.randn(2000) for _ in range(256)]  # 8 KB rows (inline), 2 MB per batch: many parts
    client.put_rows(1, [{"x": t, "i": i} for i, t in enumerate(big)])
    second = client.get("c", ["x", "i"], 256, timeout=10, group_aware=False, ack=first.keys)
    assert second.data["i"] == list(range(256))
    assert all(torch.equal(a, b) for a, b in zip(second.data["x"], big, strict=True))
    m = client.metrics()
    assert m["queue/rows_consumed/c"] == 4 and m["queue/rows"] == 256  # the first batch was acked and evicted
    client.put_rows(2, [{"x": torch.ones(3)}])
    third = client.get("c", ["x"], 1, timeout=10, group_aware=False, ack=second.keys)  # guess now too high
    assert torch.equal(third.data["x"][0], torch.ones(3)) and client.metrics()["queue/rows"] == 1
    ray.kill(client.actor)


def test_a_timed_out_get_leaves_no_unhandled_ray_error(ray_local, monkeypatch):
    """A consumer polling an empty queue (every async step's reward thread does) must not make Ray
    report an "Unhandled error" for the other return values of the multi-return actor call."""
    import gc

    import ray._private.worker as ray_worker

    unhandled: list[Exception] = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", unhandled.append)
    client = ray_queue(8, consumers=["reward"])
    client.row_bytes = 1 << 20  # a large previous batch: the next get asks for several blob parts
    for _ in range(3):
        with pytest.raises(TimeoutError, match="consumer 'reward' waited 0.05s"):
            client.get("reward", ["x"], batch_size=4, timeout=0.05)
    gc.collect()
    time.sleep(1.0)  # Ray reports unretrieved errors when the refs are freed
    assert unhandled == []
    ray.kill(client.actor)
