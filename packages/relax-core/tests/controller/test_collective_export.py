"""Collective weight export: a trainer whose export gathers across its ranks (``collective_export``)
streams and syncs its weights from rank 0 while every peer rank exports in step.

The trainer plugin (``plugins/gather_trainer.py``) all-gathers each weight over gloo between two real
rank actors. Without the collective path, rank 0 would wait alone in the first all-gather (gloo's
default timeout is 30 min); the last test shows exactly that failure, with a short group timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import torch

from relax.core.config import config_from_dict
from relax.core.context import PluginContext
from relax.core.controller.roles import TrainerRole
from relax.core.controller.worker_group import spawn
from relax.core.weight_sync import ObjectStoreSync, serve_receiver

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(240)
PLUGINS = Path(__file__).parent / "plugins"
WORLD = 2


def gathered(index: int) -> torch.Tensor:
    """What the export of weight ``index`` must be: every rank's shard, in rank order."""
    return torch.cat(
        [torch.arange(4, dtype=torch.float32) + 100 * index + 10 * rank for rank in range(WORLD)]
    )


class DictEngine:
    def __init__(self):
        self.state, self.version = {}, -1

    def update_weights(self, named_tensors, version):
        self.state.update({n: t.clone() for n, t in named_tensors})
        self.version = version

    def weight_version(self):
        return self.version


@ray.remote(num_cpus=0)
class EngineHost:
    def __init__(self):
        self.engine = DictEngine()

    def weight_receiver(self, spec, method, *args):
        return serve_receiver(self, self.engine, spec, method, *args)

    def state(self):
        return self.engine.state


@pytest.fixture(scope="module")
def group(ray_local):
    """Two ``TrainerRole`` ranks of the gather trainer; rank 0 leads rank 1, as ``relax run`` sets it up."""
    cfg = config_from_dict({"trainer": {"backend": "gather_test"}}, check_plugins=False)
    env = {"env_vars": {"RELAX_PLUGINS": "gather_trainer", "PYTHONPATH": str(PLUGINS)}}
    node = ray.get_runtime_context().get_node_id()

    def rank_args(info):
        ctx = PluginContext(
            role="trainer",
            index=info.rank,
            world_size=info.world_size,
            master_addr=info.master_addr,
            master_port=info.master_port,
        )
        return (cfg, ctx), {"num_threads": 1}

    workers = spawn(
        TrainerRole,
        "trainer",
        [{"num_cpus": 0, "runtime_env": env}] * WORLD,
        rank_args,
        [node] * WORLD,
        timeout_s=180,
    )
    ray.get(workers.handles[0].lead.remote(workers.peers()), timeout=60)
    yield workers
    workers.kill()


def test_rank0_streams_the_gathered_buckets_while_peers_export_in_step(group):
    leader = group.handles[0]
    stream = leader.export_weights.options(num_returns="streaming").remote(1 << 10)
    buckets = [ray.get(ref, timeout=60) for ref in stream]
    assert [[n for n, _ in b] for b in buckets] == [["w0"], ["w1"], ["w2"]]
    for i, bucket in enumerate(buckets):
        assert torch.equal(bucket[0][1], gathered(i))
    # the peer left the export with rank 0: the next collective (an all-reduce) pairs up
    assert ray.get(leader.train_step.remote({}), timeout=60) == {"rank_sum": 3.0, "steps": 1.0}


def test_a_weight_sync_sends_rank0s_gathered_weights(group):
    engine = EngineHost.remote()
    sync = ObjectStoreSync(ctx=PluginContext(role="weight_sync", timeout_s=30, bucket_bytes=1 << 10))
    stats = sync.sync(group.handles[0], [engine], 7)
    assert stats["buckets"] == 3 and stats["engines"] == 1
    state = ray.get(engine.state.remote(), timeout=60)
    assert sorted(state) == ["w0", "w1", "w2"]
    for i in range(3):
        assert torch.equal(state[f"w{i}"], gathered(i))
    assert ray.get(group.handles[0].train_step.remote({}), timeout=60)["steps"] == 2.0
    ray.kill(engine)


def test_without_collective_export_rank0_waits_alone_and_fails(group):
    """The behaviour before the fix (export on rank 0 only): the gather never pairs up. Runs last, as
    it leaves the gloo group broken."""
    leader = group.handles[0]
    ray.get(leader.call.remote("__setattr__", "collective_export", False), timeout=60)
    stream = leader.export_weights.options(num_returns="streaming").remote(1 << 10)
    with pytest.raises(ray.exceptions.RayTaskError, match="(?i)timed out|timeout"):
        [ray.get(ref, timeout=60) for ref in stream]
