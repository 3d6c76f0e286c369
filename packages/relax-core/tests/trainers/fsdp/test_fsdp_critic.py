"""The PPO critic on the fsdp trainer: each rank a replica trained on its own rows, gradients and counts summed
over the ranks. World size 2 (two Ray actor processes, gloo) against world size 1 (this process) on the same
batch: the same values, critic update (through warm-up and the joint step) and weights on both replicas; the
checkpoint carries rank 0's critic and every rank loads it."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # build runs in the rank actors

KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4, "critic_warmup_steps": 1}
CRITIC_METRICS = ("vf_loss", "vf_clip_frac", "values_mean", "critic_grad_norm")


def build(model_dir: str, rank: int = 0, world: int = 1, port: int | None = None):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.critic import Critic
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    def critic(device, sums):
        return Critic(model_dir, lr=1e-3, eps=1e-4, micro_batch_size=2, device=device, data_parallel=sums)

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(world_size=world),
        master_addr="127.0.0.1" if port else None,
        master_port=port,
        critic=critic,
        **KW,
    )


def critic_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fsdp_critic") / "m", seed=3, initializer_range=0.2)


def test_world_2_trains_the_critic_like_world_1(world2, model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=7, seed=6), tok.pad_token_id)  # shares of 4 and 3 rows
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    batch["returns"] = torch.linspace(-1.0, 1.0, mask.shape[0])[:, None] * mask
    single = build(model_dir)
    try:
        world2.build(build, model_dir)
        values = world2.call("forward_values", batch)
        torch.testing.assert_close(values, single.forward_values(batch), rtol=0, atol=1e-6)
        batch["values"] = values + 0.1 * mask
        before = critic_state(single)
        for step in range(2):  # warm-up (the critic only), then both
            got, want = world2.call("train_step", batch), single.train_step(dict(batch))
            for key in (*CRITIC_METRICS, "actor_updated"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
        assert got["actor_updated"] == 1.0
        expected = critic_state(single)
    finally:
        single.close()
    w0, w1 = ray.get([r.apply.remote(critic_state) for r in world2.ranks], timeout=120)
    assert sum(float((expected[k] - before[k]).norm()) for k in before) > 1e-3, (
        "the critic did not move: vacuous"
    )
    for name, ref in expected.items():
        assert torch.equal(w0[name], w1[name]), f"critic replicas diverged on {name}"
        torch.testing.assert_close(w0[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    world2.call("save", str(tmp_path / "ckpt"))
    world2.call("train_step", batch)
    world2.call("load", str(tmp_path / "ckpt"))
    for weights in ray.get([r.apply.remote(critic_state) for r in world2.ranks], timeout=120):
        assert all(torch.equal(weights[k], v) for k, v in w0.items())
