"""``trainer.offload`` at fsdp world size 2 (two Ray actor processes, gloo): each rank moves its own 1/2 of the
DTensor parameters and of the AdamW state to fresh host storage and back bit for bit, and the run goes on to
the same loss, gradient norm and weights as a world that never offloaded."""

from __future__ import annotations

import sys

import ray
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples
from relax.core.testing.trainer import learning_metrics
from relax.core.trainers.offload import PARTS

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # build and the checks run in the rank actors

KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4}


def build(model_dir: str, rank: int, world: int, port: int):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(world_size=world),
        master_addr="127.0.0.1",
        master_port=port,
        **KW,
    )


def local_state(trainer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and optimizer-state tensor, in a fixed order (the live tensors)."""
    params = list(trainer.model.parameters())
    state = [v for p in params for v in trainer.optimizer.state[p].values() if torch.is_tensor(v)]
    return [getattr(t, "_local_tensor", t) for t in params + state]


def round_trip(trainer) -> dict[str, bool]:
    """Offload everything and onload it on this rank; whether every shard came back equal, in new storage."""
    before = [t.clone() for t in local_state(trainer)]
    shards = sum(t.numel() for t in before)
    trainer.offload(PARTS)
    on_host = local_state(trainer)  # kept alive: the onloaded copies cannot reuse their storage
    trainer.onload()
    after = local_state(trainer)
    return {
        "half": shards > 0,
        "equal": all(torch.equal(a, b) for a, b in zip(after, before, strict=True)),
        "new storage": {t.data_ptr() for t in after if t.numel()}.isdisjoint(
            t.data_ptr() for t in on_host if t.numel()
        ),
    }


def test_world_2_offload_round_trip_changes_nothing(world2, tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=4, initializer_range=0.2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = make_batch(make_samples(tokenizer, rows=5, seed=2), tokenizer.pad_token_id)
    second = {**first, "advantages": -first["advantages"]}

    world2.build(build, model_dir)
    world2.call("train_step", dict(first))
    want = world2.call("train_step", dict(second))
    want_w = world2.export()

    world2.build(build, model_dir)
    world2.call("train_step", dict(first))
    for rank in ray.get([r.apply.remote(round_trip) for r in world2.ranks], timeout=300):
        assert rank == {"half": True, "equal": True, "new storage": True}
    assert learning_metrics(world2.call("train_step", dict(second))) == learning_metrics(
        want
    )  # bit-identical
    assert all(torch.equal(t, want_w[n]) for n, t in world2.export().items())
