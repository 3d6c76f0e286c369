"""Weight-sync transports between a trainer actor and engine actors (dict-backed, awkward dtypes):
bit-identical delivery, begin/end around every update, the version handshake, and dead/stuck engines
or trainers turning into a WeightSyncError that names them, within the timeout."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time

import pytest
import ray
import torch

from relax.core.context import PluginContext
from relax.core.plugins import get_plugin_manager
from relax.core.protocols import WeightSync
from relax.core.weight_sync import (
    TRANSPORTS,
    BroadcastParams,
    InProcessSync,
    Transport,
    WeightSyncError,
    serve_receiver,
    serve_sender,
)
from relax.core.weight_sync.flat import ZeroCopyBucket, chunks, pack, plan, segments, unpack

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(180)
BUCKET = 16 << 10


def make_state(seed: int = 0, big: int = 0) -> dict[str, torch.Tensor]:
    """Awkward dtypes and shapes on purpose: bf16, 0-dim fp16, bool, int, non-contiguous, empty, large."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(96, 64, generator=g),
        "layers.0.attn.q.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "layers.0.norm.scale": torch.tensor(1.5 + seed, dtype=torch.float16),
        "layers.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "layers.0.ids": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "lm_head.weight": torch.randn(12, 40, generator=g).t(),
        "empty": torch.zeros(0, 4),
        "lm_head.big": torch.randn(700, 600, generator=g).t(),  # >= 1 MiB: broadcast sends it directly
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
    def __init__(self, state: dict[str, torch.Tensor], slow_s: float = 0.0):
        self.state, self.slow_s = state, slow_s

    def export_weights(self, bucket_bytes: int = 64 << 20):
        bucket, size = [], 0
        for name, t in self.state.items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                time.sleep(self.slow_s)
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


class DictEngine:
    """Minimal engine: a dict of tensors, a version, a log of weight-update calls; ``fault`` injects failures."""

    def __init__(self, name: str = "dict", fault: str = ""):
        self.name, self.fault = name, fault
        self.state: dict[str, torch.Tensor] = {}
        self.version = -1
        self.calls: list[str] = []
        self.unblock = threading.Event()

    def begin_weight_update(self, version: int) -> None:
        self.calls.append(f"begin {version}")

    def update_weights(self, named_tensors, version: int) -> None:
        if self.fault == "hang":
            self.unblock.wait()
        if self.fault == "slow":
            time.sleep(0.3)
        for name, t in named_tensors:
            self.state[name] = t.clone()
        self.calls.append(f"update {version}")
        if self.fault != "stale":
            self.version = version

    def end_weight_update(self, version: int) -> None:
        self.calls.append(f"end {version}")

    def weight_version(self) -> int:
        return self.version

    def snapshot(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors (shared engines keep tensors from earlier tests too)."""
        return {n: self.state[n] for n in names}


class EngineHost:
    """Stands in for ``RolloutRole``: hosts an engine object and the weight-sync receive endpoint."""

    def __init__(self, name: str = "dict", fault: str = ""):
        self.engine = DictEngine(name, fault)

    def weight_receiver(self, spec, method: str, *args):
        return serve_receiver(self, self.engine, spec, method, *args)

    def engine_call(self, method: str, *args):
        attr = getattr(self.engine, method)
        return attr(*args) if callable(attr) else attr


class TrainerHost:
    """Stands in for ``TrainerRole``: hosts a trainer object and the weight-sync send endpoint."""

    def __init__(self, state: dict[str, torch.Tensor], slow_s: float = 0.0):
        self.trainer = DictTrainer(state, slow_s)

    def weight_sender(self, spec, method: str, *args):
        yield from serve_sender(self, self.trainer, spec, method, *args)


EngineActor = ray.remote(num_cpus=0, max_concurrency=4)(EngineHost)
TrainerActor = ray.remote(num_cpus=0)(TrainerHost)


@pytest.fixture(scope="module")
def engines(ray_local):
    actors = [EngineActor.remote("a"), EngineActor.remote("b")]
    yield actors
    for actor in actors:
        ray.kill(actor)


def make_sync(transport: str, tmp_path, timeout_s: float = 30, **params) -> Transport:
    """Through the registry, as ``relax run`` builds it: ``factory(params, ctx)``."""
    if transport in ("disk", "shared_memory"):
        params.setdefault("directory", str(tmp_path))
    factory = get_plugin_manager().get("weight_sync", transport)
    ctx = PluginContext(role="weight_sync", timeout_s=timeout_s, bucket_bytes=BUCKET)
    return factory(TRANSPORTS[transport].config(**params), ctx)


def calls_of(engine) -> list[str]:
    return (
        list(engine.calls) if isinstance(engine, DictEngine) else ray.get(engine.engine_call.remote("calls"))
    )


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


def test_segments_cover_every_tensor_once_and_bound_runs():
    state = make_state(big=40_000)
    layout, total = plan(list(state.items()))
    segs = segments(layout, direct_bytes=16 << 10, run_bytes=20_000)
    assert [i for s in segs for i in range(s.first, s.last)] == list(range(len(layout)))
    for s in segs:
        assert (
            s.start == layout[s.first][3] and s.end == layout[s.last - 1][3] + layout[s.last - 1][4] <= total
        )
        if s.direct:
            assert s.last == s.first + 1 and layout[s.first][4] >= 16 << 10
        else:
            assert s.end - s.start <= 20_000 and all(layout[i][4] < 16 << 10 for i in range(s.first, s.last))
    assert any(s.direct for s in segs) and any(not s.direct for s in segs)


@pytest.mark.parametrize("where", ["actor", "local"])
@pytest.mark.parametrize("transport", ["in_process", "object_store", "broadcast", "disk", "shared_memory"])
def test_delivery_is_bit_identical_versioned_and_bracketed(engines, transport, where, tmp_path):
    """Trainer actor → engine actors (the run's path), or a local trainer (colocated) → actors and
    local engines: every byte arrives, every engine serves the version, begin/end bracket the buckets."""
    sync = make_sync(transport, tmp_path)
    assert isinstance(sync, WeightSync)
    local_engines = [DictEngine("local")] if where == "local" and transport != "broadcast" else []
    targets = list(engines) + local_engines
    for version in (1, 2):  # the second round reuses the broadcast group and overwrites every tensor
        state = make_state(seed=version, big=20_000)
        trainer = TrainerActor.remote(state) if where == "actor" else DictTrainer(state)
        before = [len(calls_of(e)) for e in targets]
        stats = sync.sync(trainer, targets, version)
        assert stats["bytes"] == nbytes(state) and stats["buckets"] >= 4 and stats["engines"] == len(targets)
        assert stats["bytes_per_s"] == pytest.approx(stats["bytes"] / stats["seconds"])
        logs = [calls_of(e)[n:] for e, n in zip(targets, before, strict=True)]
        for engine in local_engines:
            assert_identical(engine.snapshot(list(state)), state)
            assert engine.weight_version() == version
        for engine in engines:
            assert_identical(ray.get(engine.engine_call.remote("snapshot", list(state)), timeout=30), state)
            assert ray.get(engine.engine_call.remote("weight_version"), timeout=30) == version
        for log in logs:
            assert log[0] == f"begin {version}" and log[-1] == f"end {version}", log
            assert len(log) >= 3 and set(log[1:-1]) == {f"update {version}"}, log
        if where == "actor":
            ray.kill(trainer)
    if transport == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001", "v00000002"]


def test_params_are_typed_from_yaml_and_checked():
    from relax.core.config import ConfigError, load_config

    cfg = load_config(
        None, ["mode=async", "weight_sync.transport=broadcast", "weight_sync.params={backend: nccl}"]
    )
    assert cfg.weight_sync.params == BroadcastParams(backend="nccl", master_addr=None)
    with pytest.raises(ConfigError, match=r"weight_sync\.params\.backend"):
        load_config(None, ["weight_sync.transport=broadcast", "weight_sync.params={backend: mpi}"])
    with pytest.raises(ConfigError, match=r"weight_sync\.params\.max_inflight"):
        load_config(None, ["weight_sync.transport=object_store", "weight_sync.params={max_inflight: 0}"])
    sync = TRANSPORTS["broadcast"](timeout_s=5, backend="gloo")  # keywords override params and ctx
    assert sync.params.backend == "gloo" and sync.timeout_s == 5 and sync.spec.name == "broadcast"


def test_nccl_in_colocate_is_refused_by_validation():
    """Colocate puts trainer rank 0 and engine 0 on one GPU; NCCL cannot have two ranks of a group on one device."""
    from relax.core.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"weight_sync\.params\.backend: nccl in mode 'colocate'.*use backend gloo"
    ):
        load_config(
            None, ["mode=colocate", "weight_sync.transport=broadcast", "weight_sync.params={backend: nccl}"]
        )
    assert (
        load_config(None, ["mode=colocate", "weight_sync.transport=broadcast"]).weight_sync.params.backend
        == "gloo"
    )


def test_transport_declares_the_engines_it_serves():
    class OnlyHF(InProcessSync):
        engines = ("hf",)

    OnlyHF().check_engine("hf")
    with pytest.raises(
        WeightSyncError, match=r"transport 'in_process' cannot serve rollout\.engine 'sglang'.*hf"
    ):
        OnlyHF().check_engine("sglang")
    for cls in TRANSPORTS.values():
        cls().check_engine("anything")  # the built-ins serve every engine with update_weights
    with pytest.raises(
        WeightSyncError, match=r"transport 'in_process' cannot serve engine object.*update_weights"
    ):
        InProcessSync(timeout_s=5).sync(DictTrainer(make_state()), [object()], 1)
    with pytest.raises(
        WeightSyncError, match=r"broadcast transport needs engines that are Ray actors.*engine\[0\]"
    ):
        TRANSPORTS["broadcast"](timeout_s=5).sync(DictTrainer(make_state()), [DictEngine("x")], 1)


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
    assert time.monotonic() - start < 1 + 15  # at its timeout: the stuck engine never finishes by itself
    stuck.unblock.set()


@pytest.mark.parametrize(
    ("transport", "what"),
    [
        ("in_process", "update_weights"),
        ("object_store", "update_weights"),
        ("disk", "load"),
        ("broadcast", "receive"),
    ],
)
def test_stuck_engine_actor_times_out_naming_it(engines, tmp_path, transport, what):
    stuck = EngineActor.remote("stuck", "hang")
    ray.get(stuck.engine_call.remote("weight_version"), timeout=60)  # started
    trainer = TrainerActor.remote(make_state())
    ray.get(trainer.__ray_ready__.remote(), timeout=60)  # its start-up is not part of the bound
    name = f"engine\\[1\\] \\(EngineHost actor {stuck._actor_id.hex()[:12]}\\)"
    start = time.monotonic()
    # 5 s per phase: a loaded machine's actor can take 2 s to answer begin_weight_update; the stuck phase never ends
    with pytest.raises(WeightSyncError, match=f"{name}.*{what}"):
        make_sync(transport, tmp_path, timeout_s=5).sync(trainer, [engines[0], stuck], 1)
    assert time.monotonic() - start < 5 + 15  # at the timeout, not later: the stuck call never returns
    ray.kill(stuck)
    ray.kill(trainer)


@pytest.mark.parametrize("transport", ["in_process", "object_store", "broadcast", "disk"])
def test_engine_killed_mid_sync_fails_fast_naming_it(engines, transport, tmp_path):
    victim = EngineActor.remote("victim", "slow")
    ray.get(victim.engine_call.remote("weight_version"), timeout=60)
    name = f"engine[1] (EngineHost actor {victim._actor_id.hex()[:12]})"
    sync = make_sync(transport, tmp_path, timeout_s=20)
    state = make_state(big=100_000)  # ~25 buckets of 16 KiB at 0.3 s each on the victim
    trainer = TrainerActor.remote(state)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sync.sync, trainer, [engines[1], victim], 5)
        time.sleep(3.0)
        assert not fut.done()
        ray.kill(victim)
        with pytest.raises(WeightSyncError) as err:
            fut.result(timeout=30)
    # detected as dead, not waited out: the error says it died (a timeout would say "did not finish ... within")
    assert name in str(err.value) and "died" in str(err.value) and "did not finish" not in str(err.value)
    ray.kill(trainer)


def test_trainer_killed_mid_push_is_named(engines, tmp_path):
    trainer = TrainerActor.remote(make_state(big=40_000), slow_s=0.5)
    sync = make_sync("object_store", tmp_path, timeout_s=20)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sync.sync, trainer, list(engines), 9)
        time.sleep(2.0)
        ray.kill(trainer)
        killed = time.monotonic()
        with pytest.raises(
            WeightSyncError, match=rf"trainer \(TrainerHost actor {trainer._actor_id.hex()[:12]}\) died"
        ):
            fut.result(timeout=30)
    assert time.monotonic() - killed < 10


THIRD_PARTY = '''
from dataclasses import dataclass

from relax.core.weight_sync import Receiver, Transport
from relax.core.weight_sync.base import bucket_nbytes


@dataclass(frozen=True)
class PerTensorParams:
    scale: int = 1  # sent tensors are multiplied by this (so the test sees its params arrive)


class PerTensorReceiver(Receiver):
    def put(self, name, tensor, version):
        self.engine.update_weights([(name, tensor)], version)


class PerTensorSync(Transport):
    """A toy transport: one receiver call per tensor."""

    name = "per_tensor"
    config = PerTensorParams
    receiver_cls = PerTensorReceiver
    engines = ("dict",)

    def send(self, trainer, peers, version):
        for bucket in trainer.export_weights(self.bucket_bytes):
            for name, tensor in bucket:
                peers.call("put", name, tensor * self.params.scale, version, what=f"put({name})")
            yield bucket_nbytes(bucket)


def relax_register_weight_syncs(register):
    register("per_tensor", PerTensorSync, config=PerTensorParams)
'''


def test_third_party_transport_plugs_in_through_the_registry(ray_local, tmp_path):
    """A plugin module registers a Transport subclass; the trainer and engine actors load it from
    ``RELAX_PLUGINS`` and rebuild it by name, with its typed params, in their own processes."""
    (tmp_path / "third_party_ws.py").write_text(THIRD_PARTY)
    sys.path.insert(0, str(tmp_path))
    try:
        from relax.core.plugins import RelaxPluginManager

        manager = RelaxPluginManager(extra_plugins={"third_party_ws": __import__("third_party_ws")})
        registration = manager.registration("weight_sync", "per_tensor")
        sync = registration.factory(
            registration.config(scale=3), PluginContext(role="weight_sync", timeout_s=30)
        )
    finally:
        sys.path.remove(str(tmp_path))
    sync.check_engine("dict")
    with pytest.raises(WeightSyncError, match="cannot serve rollout.engine 'hf'"):
        sync.check_engine("hf")
    env = {"env_vars": {"RELAX_PLUGINS": "third_party_ws", "PYTHONPATH": str(tmp_path)}}
    state = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    trainer = TrainerActor.options(runtime_env=env).remote(state)
    engines = [EngineActor.options(runtime_env=env).remote(f"e{i}") for i in range(2)]
    stats = sync.sync(trainer, engines, 4)
    assert stats["bytes"] == nbytes(state) and stats["engines"] == 2
    for engine in engines:
        assert_identical(
            ray.get(engine.engine_call.remote("snapshot", list(state))), {n: t * 3 for n, t in state.items()}
        )
        assert ray.get(engine.engine_call.remote("calls")) == ["begin 4", "update 4", "update 4", "end 4"]
    for actor in [trainer, *engines]:
        ray.kill(actor)
