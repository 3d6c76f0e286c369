"""Weight-sync transports against real Ray actors: bit-identical delivery, version handshake,
and dead/stuck receivers turning into a WeightSyncError that names the engine, within the timeout."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time

import pytest
import ray
import torch

from relax.core.protocols import WeightSync
from relax.core.weight_sync import (
    TRANSPORTS,
    BroadcastReceiver,
    BroadcastSync,
    DiskReceiver,
    DiskSync,
    InProcessSync,
    ObjectStoreSync,
    WeightSyncError,
)
from relax.core.weight_sync.flat import ZeroCopyBucket, chunks, pack, unpack

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)
BUCKET = 16 << 10


def make_state(seed: int = 0, big: int = 0) -> dict[str, torch.Tensor]:
    """Awkward dtypes and shapes on purpose: bf16, 0-dim fp16, bool, int, non-contiguous, empty."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(96, 64, generator=g),
        "layers.0.attn.q.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "layers.0.norm.scale": torch.tensor(1.5 + seed, dtype=torch.float16),
        "layers.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "layers.0.ids": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "lm_head.weight": torch.randn(12, 40, generator=g).t(),
        "empty": torch.zeros(0, 4),
    }
    for i in range(big // 4096):  # 16 KiB each: one trainer bucket apiece
        state[f"layers.{i + 1}.mlp.weight"] = torch.randn(64, 64, generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        a, b = got[name].contiguous().reshape(-1), t.contiguous().reshape(-1)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


class DictTrainer:
    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def export_weights(self, bucket_bytes: int = 64 << 20):
        bucket, size = [], 0
        for name, t in self.state.items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


class ListTrainer(DictTrainer):
    """Returns all buckets at once, as a trainer role wrapping a generator in ``list()`` does."""

    def export_weights(self, bucket_bytes: int = 64 << 20):
        return list(super().export_weights(bucket_bytes))


class DictEngine(BroadcastReceiver, DiskReceiver):
    """Minimal receiver: a dict of tensors and a version; ``fault`` injects failures."""

    def __init__(self, name: str = "dict", fault: str = ""):
        self.name = name
        self.fault = fault
        self.state: dict[str, torch.Tensor] = {}
        self.version = -1
        self.unblock = threading.Event()

    def update_weights(self, named_tensors, version: int) -> None:
        if self.fault == "hang":
            self.unblock.wait()
        if self.fault == "slow":
            time.sleep(0.3)
        for name, t in named_tensors:
            self.state[name] = t.clone()
        if self.fault != "stale":
            self.version = version

    def receive_broadcast(self, meta, version: int) -> int:
        if self.fault == "hang_receive":
            self.unblock.wait()
        return super().receive_broadcast(meta, version)

    def weight_version(self) -> int:
        return self.version

    def snapshot(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (shared engines keep tensors from earlier tests too)."""
        return {n: self.state[n] for n in names}


EngineActor = ray.remote(num_cpus=0)(DictEngine)
TrainerActors = {
    "generator": ray.remote(num_cpus=0)(DictTrainer),
    "list": ray.remote(num_cpus=0)(ListTrainer),
}


@pytest.fixture(scope="module")
def engines(ray_local):
    actors = [EngineActor.remote("a"), EngineActor.remote("b")]
    yield actors
    for actor in actors:
        ray.kill(actor)


def test_pack_unpack_is_bit_identical_with_fixed_size_chunks():
    state = make_state()
    flat, layout = pack(list(state.items()))
    assert all(off % 64 == 0 for *_, off, _ in layout)
    pieces = chunks(flat, 1000)
    assert [p.numel() for p in pieces[:-1]] == [1000] * (len(pieces) - 1) and 0 < pieces[-1].numel() <= 1000
    assert_identical(dict(unpack(torch.cat(pieces), layout)), state)
    assert_identical(
        dict(ray.cloudpickle.loads(ray.cloudpickle.dumps(ZeroCopyBucket(list(state.items()))))), state
    )


@pytest.mark.parametrize("transport", ["in_process", "object_store", "broadcast", "disk"])
def test_delivery_is_bit_identical_and_versioned(engines, transport, tmp_path):
    kw = {"directory": str(tmp_path)} if transport == "disk" else {}
    sync = TRANSPORTS[transport](timeout_s=30, bucket_bytes=BUCKET, **kw)
    assert isinstance(sync, WeightSync)
    targets = list(engines) + (
        [DictEngine("local")] if transport in ("in_process", "object_store", "disk") else []
    )
    for version in (1, 2):  # the second round reuses the broadcast group and overwrites every tensor
        state = make_state(seed=version, big=20_000)
        stats = sync.sync(DictTrainer(state), targets, version)
        assert stats["bytes"] == nbytes(state) and stats["buckets"] >= 4
        assert stats["bytes_per_s"] == pytest.approx(stats["bytes"] / stats["seconds"])
        for engine in targets:
            if isinstance(engine, DictEngine):
                assert_identical(engine.snapshot(list(state)), state)
                assert engine.weight_version() == version
            else:
                assert_identical(ray.get(engine.snapshot.remote(list(state)), timeout=30), state)
                assert ray.get(engine.weight_version.remote(), timeout=30) == version
    if transport == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001", "v00000002"]


@pytest.mark.parametrize(
    ("transport", "export"), [("object_store", "generator"), ("in_process", "list"), ("object_store", "list")]
)
def test_trainer_as_actor(engines, transport, export):
    state = make_state(seed=7, big=10_000)
    trainer = TrainerActors[export].remote(state)
    stats = TRANSPORTS[transport](timeout_s=30, bucket_bytes=BUCKET).sync(trainer, engines, 7)
    assert stats["bytes"] >= nbytes(state) and stats["buckets"] >= 3  # streamed: serialized bytes
    for engine in engines:
        assert_identical(ray.get(engine.snapshot.remote(list(state)), timeout=30), state)
    ray.kill(trainer)


def test_engines_disagreeing_on_version_is_an_error():
    good, stale = DictEngine("good"), DictEngine("stale", fault="stale")
    with pytest.raises(WeightSyncError, match=r"disagree.*version 3.*wrong: \['engine\[1\] \(stale\)'\]"):
        InProcessSync(timeout_s=5, bucket_bytes=BUCKET).sync(DictTrainer(make_state()), [good, stale], 3)


def test_stuck_local_engine_times_out_naming_it():
    stuck = DictEngine("stuck", fault="hang")
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=r"engine\[1\] \(stuck\) did not finish update_weights.*within 1s"
    ):
        InProcessSync(timeout_s=1, bucket_bytes=BUCKET).sync(
            DictTrainer(make_state()), [DictEngine(), stuck], 1
        )
    assert time.monotonic() - start < 3
    stuck.unblock.set()


@pytest.mark.parametrize(
    ("make", "fault", "what"),
    [
        (lambda d: ObjectStoreSync(timeout_s=2, bucket_bytes=BUCKET), "hang", "update_weights"),
        (lambda d: DiskSync(timeout_s=2, bucket_bytes=BUCKET, directory=d), "hang", "load_weights_from_disk"),
        (lambda d: BroadcastSync(timeout_s=2, bucket_bytes=BUCKET), "hang_receive", "receive_broadcast"),
    ],
    ids=["object_store", "disk", "broadcast"],
)
def test_stuck_actor_engine_times_out_naming_it(engines, tmp_path, make, fault, what):
    stuck = EngineActor.remote("stuck", fault)
    ray.get(stuck.weight_version.remote(), timeout=60)  # started
    name = f"engine\\[1\\] \\(DictEngine actor {stuck._actor_id.hex()[:12]}\\)"
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"{name}.*{what}"):
        make(str(tmp_path)).sync(DictTrainer(make_state()), [engines[0], stuck], 1)
    assert time.monotonic() - start < 2 + 7  # timeout plus grace for naming the culprit
    ray.kill(stuck)


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_engine_killed_mid_sync_fails_fast_naming_it(engines, transport):
    victim = EngineActor.remote("victim", "slow")
    ray.get(victim.weight_version.remote(), timeout=60)
    name = f"engine[1] (DictEngine actor {victim._actor_id.hex()[:12]})"
    sync = TRANSPORTS[transport](timeout_s=20, bucket_bytes=BUCKET)
    state = make_state(big=100_000)  # ~25 buckets of 16 KiB at 0.3 s each on the victim
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sync.sync, DictTrainer(state), [engines[1], victim], 5)
        time.sleep(1.5)
        assert not fut.done()
        ray.kill(victim)
        killed = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            fut.result(timeout=30)
    assert time.monotonic() - killed < 10  # detected as dead, not waited out
    assert name in str(err.value) and "died" in str(err.value)
