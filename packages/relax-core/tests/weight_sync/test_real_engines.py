"""Every transport between the real torch trainer role and real HF engine roles: bit-identical
weights, the new version served (and sampled from), begin/end around the buckets, dead and stuck
engines named within the timeout, no weights in the driver, and a loopback-only broadcast store."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.context import PluginContext
from relax.core.controller.contexts import engine_context, trainer_context
from relax.core.controller.roles import RolloutRole, TrainerRole
from relax.core.data import Sample, collate
from relax.core.plugins import get_plugin_manager
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import build_tiny_model, ensure_quickstart_model
from relax.core.weight_sync import WeightSyncError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(600)
PROMPT = [1, 2, 3, 4, 5]
TRANSPORTS = ["in_process", "object_store", "broadcast", "disk"]


class Recorder:
    """Wraps a hosted engine: records the weight-update calls in order; ``fault`` makes the first
    ``update_weights`` block forever (to be killed) or SIGSTOP its own process (stuck)."""

    def __init__(self, engine, fault: str = "", marker: str = ""):
        self.inner, self.fault, self.marker, self.calls = engine, fault, marker, []

    def begin_weight_update(self, version: int) -> None:
        self.calls.append(("begin", version))

    def update_weights(self, named_tensors, version: int) -> None:
        named = list(named_tensors)
        self.calls.append(("update", version))
        if self.fault and self.marker:
            Path(self.marker).write_text(str(os.getpid()))
        if self.fault == "block":
            while True:
                time.sleep(1)
        if self.fault == "stop":
            self.fault = ""
            os.kill(os.getpid(), signal.SIGSTOP)
        self.inner.update_weights(named, version)

    def end_weight_update(self, version: int) -> None:
        self.calls.append(("end", version))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _install_recorder(role, fault: str = "", marker: str = "") -> int:
    """Wrap the role's engine in a Recorder; returns the engine process id."""

    def wrap(actor, fault, marker):
        actor.engine = Recorder(actor.engine, fault, marker)
        return os.getpid()

    return ray.get(role.__ray_call__.remote(wrap, fault, marker), timeout=120)


def _calls(role) -> list[tuple]:
    return ray.get(role.__ray_call__.remote(lambda actor: list(actor.engine.calls)), timeout=60)


def _pid(role) -> int:
    return ray.get(role.__ray_call__.remote(lambda actor: os.getpid()), timeout=60)


def start_trainer(cfg, path):
    return TrainerRole.options(num_cpus=0).remote(cfg, trainer_context(cfg, path))


def start_engine(cfg, path, index: int):
    role = RolloutRole.options(num_cpus=0, max_concurrency=4).remote(cfg, engine_context(cfg, path, index))
    ray.get(role.weight_version.remote(), timeout=120)
    return role


def make_sync(transport: str, tmp_path, timeout_s: float, bucket_bytes: int):
    factory = get_plugin_manager().get("weight_sync", transport)
    params = {"directory": str(tmp_path / "weights")} if transport == "disk" else {}
    ctx = PluginContext(role="weight_sync", timeout_s=timeout_s, bucket_bytes=bucket_bytes)
    return factory(factory.config(**params), ctx)


def exported(trainer) -> dict[str, torch.Tensor]:
    """The trainer's weights, streamed bucket by bucket from ``TrainerRole.export_weights``."""
    return {n: t for ref in trainer.export_weights.remote(1 << 20) for n, t in ray.get(ref)}


@pytest.fixture(scope="module")
def quick(ray_session):
    cfg = load_config(None, ["trainer.lr=0.01"])
    path = ensure_quickstart_model()
    trainer = start_trainer(cfg, path)
    engines = [start_engine(cfg, path, i) for i in range(2)]
    for engine in engines:
        _install_recorder(engine)
    yield cfg, path, trainer, engines
    for handle in [trainer, *engines]:
        ray.kill(handle)


def _sample(engine, seed: int = 7):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, seed=seed)
    (result,) = ray.get(engine.generate.remote([GenerationRequest("r", PROMPT, params)]))
    return result


def _step_trainer(trainer) -> None:
    """One real policy-gradient step so the trainer's weights differ from the engines'."""
    sample = Sample(prompt_ids=PROMPT, group_id=0, response_ids=[6, 7, 8, 9], loss_mask=[1.0] * 4)
    batch = collate([sample], 0)
    batch["old_logprobs"] = ray.get(trainer.forward_logprobs.remote(batch))
    batch["advantages"] = torch.ones_like(batch["response_mask"])
    ray.get(trainer.train_step.remote(batch))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transport_updates_real_engines(quick, transport, tmp_path):
    cfg, _, trainer, engines = quick
    before = _sample(engines[0])
    _step_trainer(trainer)
    version = ray.get(engines[0].weight_version.remote()) + 1
    logged = [len(_calls(e)) for e in engines]
    stats = make_sync(transport, tmp_path, timeout_s=60, bucket_bytes=1 << 16).sync(trainer, engines, version)
    assert stats["bytes"] > 0 and stats["buckets"] > 1 and stats["engines"] == 2
    weights = exported(trainer)
    for engine, n in zip(engines, logged, strict=True):
        assert ray.get(engine.weight_version.remote()) == version
        served = ray.get(engine.call.remote("state_dict"))
        assert served.keys() >= weights.keys()
        for name, tensor in weights.items():
            assert torch.equal(served[name], tensor), (transport, name)
        calls = _calls(engine)[n:]
        assert calls[0] == ("begin", version) and calls[-1] == ("end", version), calls
        assert len(calls) >= 3 and set(calls[1:-1]) == {("update", version)}, calls
    after = _sample(engines[1])
    assert after.versions == [version] * 8
    sample = Sample(prompt_ids=PROMPT, group_id=0, response_ids=after.response_ids)
    trainer_lp = ray.get(trainer.forward_logprobs.remote(collate([sample], 0)))[0]
    assert torch.allclose(torch.tensor(after.logprobs), trainer_lp, atol=1e-4)
    if before.response_ids == after.response_ids:
        assert before.logprobs != after.logprobs


def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _sync_in_thread(sync, trainer, engines, version):
    import concurrent.futures as cf

    pool = cf.ThreadPoolExecutor(1)
    fut = pool.submit(sync.sync, trainer, engines, version)
    pool.shutdown(wait=False)
    return fut


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_killed_mid_transfer_is_named_fast(quick, transport, tmp_path):
    cfg, path, trainer, engines = quick
    victim = start_engine(cfg, path, 1)
    marker = tmp_path / "in_update"
    _install_recorder(victim, "block", str(marker))
    sync = make_sync(transport, tmp_path, timeout_s=60, bucket_bytes=1 << 16)
    fut = _sync_in_thread(sync, trainer, [engines[0], victim], 100)
    _wait_for(marker)  # the victim is inside update_weights, mid-transfer
    ray.kill(victim)
    killed = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        fut.result(timeout=120)
    assert time.monotonic() - killed < 20  # seen as dead, not waited out (timeout is 60 s)
    assert f"engine[1] (RolloutRole actor {victim._actor_id.hex()[:12]})" in str(err.value)
    assert "died" in str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_stopped_mid_transfer_is_named_within_timeout(quick, transport, tmp_path):
    cfg, path, trainer, engines = quick
    victim = start_engine(cfg, path, 1)
    marker = tmp_path / "in_update"
    pid = _install_recorder(victim, "stop", str(marker))
    sync = make_sync(transport, tmp_path, timeout_s=4, bucket_bytes=1 << 16)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as err:
            sync.sync(trainer, [engines[0], victim], 200)
        elapsed = time.monotonic() - start
        assert marker.exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "T"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert elapsed < 4 + 10, elapsed  # the timeout, plus grace for naming the culprit
    message = str(err.value)
    assert (
        f"engine[1] (RolloutRole actor {victim._actor_id.hex()[:12]})" in message and "within 4s" in message
    )
    assert "engine[0]" not in message
    ray.kill(victim)


def test_engine_stopped_before_sync_is_named(quick, tmp_path):
    """SIGSTOP by pid from outside: the engine cannot even join the broadcast group."""
    cfg, path, trainer, engines = quick
    victim = start_engine(cfg, path, 1)
    pid = _pid(victim)
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(
            WeightSyncError,
            match=rf"engine\[1\] \(RolloutRole actor {victim._actor_id.hex()[:12]}\).*within 4s",
        ):
            make_sync("broadcast", tmp_path, timeout_s=4, bucket_bytes=1 << 16).sync(
                trainer, [engines[0], victim], 300
            )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - start < 4 + 10
    ray.kill(victim)


# ---------------------------------------------------------------------------------- a larger model


def _status_kib(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for family, name in ((socket.AF_INET, "tcp"), (socket.AF_INET6, "tcp6")):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little endian
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


BIG_BUCKET = 8 << 20


@pytest.fixture(scope="module")
def big(ray_session, tmp_path_factory):
    """A ~50 MB Qwen3 (6x the bucket; MLP tensors of 3 MiB are sent directly by the broadcast)."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("big-model"),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    cfg = load_config(None, [])
    trainer, engine = start_trainer(cfg, path), start_engine(cfg, path, 0)
    model_bytes = sum(t.numel() * t.element_size() for t in exported(trainer).values())
    assert model_bytes >= 6 * BIG_BUCKET
    yield trainer, engine, model_bytes
    ray.kill(trainer)
    ray.kill(engine)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_driver_rss_does_not_grow_with_model_size(big, transport, tmp_path):
    trainer, engine, model_bytes = big
    sync = make_sync(transport, tmp_path, timeout_s=120, bucket_bytes=BIG_BUCKET)
    sync.sync(trainer, [engine], 1)  # warm-up: imports, broadcast group, Ray's own buffers
    Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak RSS (VmHWM)
    rss_before = _status_kib("VmRSS") << 10
    for version in (2, 3, 4):
        sync.sync(trainer, [engine], version)
    peak_extra = (_status_kib("VmHWM") << 10) - rss_before
    assert peak_extra < BIG_BUCKET // 2, (
        f"driver peak RSS grew {peak_extra >> 10} KiB syncing {model_bytes >> 20} MiB"
    )
    assert ray.get(engine.weight_version.remote()) == 4
    served = ray.get(engine.call.remote("state_dict"))
    for name, tensor in exported(trainer).items():
        assert torch.equal(served[name], tensor), (transport, name)


def test_broadcast_store_and_sockets_listen_on_loopback_only(big, tmp_path):
    trainer, engine, _ = big
    pids = {"trainer": _pid(trainer), "engine": _pid(engine)}
    before = {role: _listening(pid) for role, pid in pids.items()}
    sync = make_sync("broadcast", tmp_path, timeout_s=120, bucket_bytes=BIG_BUCKET)
    sync.sync(trainer, [engine], 5)  # the group stays up between syncs
    new = {role: _listening(pid) - before[role] for role, pid in pids.items()}
    assert new["trainer"], "the trainer should listen for the store and gloo"
    for role, sockets in new.items():
        assert {addr for addr, _ in sockets} <= {"127.0.0.1"}, (role, sockets)
