"""The PPO critic trains data-parallel on the torch trainer (``trainer.backend_params.world_size: 2``, two real
Ray rank actors over gloo, built by the backend's factory as ``relax run`` builds them): values, the critic's
update and both replicas' weights equal world size 1's on the same batch; its checkpoint is rank 0's and
every rank loads it. (The fsdp trainer's critic: ``fsdp/test_fsdp_critic.py``.)"""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.contexts import plugin_params, trainer_context
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples

ray.cloudpickle.register_pickle_by_value(
    sys.modules[__name__]
)  # critic_weights' lambda runs in the rank actors

CRITIC_METRICS = ("vf_loss", "vf_clip_frac", "values_mean", "critic_grad_norm")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("critic-dp-model"), seed=3, initializer_range=0.2)
    return load_config(
        None,
        [
            f"model.path={path}",
            f"run_dir={tmp_path_factory.mktemp('critic-dp-run')}",
            "trainer.lr=0.001",
            "rollout.prompts_per_step=3",
            "rollout.n_samples_per_prompt=2",
            "trainer.micro_batch_size=2",
            "trainer.num_minibatches=2",
            "algorithm.advantage_estimator=gae",
            "algorithm.critic.enable=true",
            "algorithm.critic.lr=0.001",
            "algorithm.critic.warmup_steps=1",
            "trainer.backend_params={world_size: 2, num_cpus: 0.5}",
        ],
    )


def ppo_batch(model_path: str, values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """7 rows (shares of 4 and 3: one rank has a row less in a mini-batch), with GAE-like targets."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    batch = make_batch(make_samples(tok, rows=7, seed=6), tok.pad_token_id)
    mask = batch["response_mask"]
    gen = torch.Generator().manual_seed(2)
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    batch["returns"] = torch.linspace(-1.0, 1.0, mask.shape[0])[:, None] * mask
    return batch


def critic_weights(handle) -> dict[str, torch.Tensor]:
    """The critic of one rank actor (``call`` goes to rank 0 only)."""
    return ray.get(
        handle.__ray_call__.remote(
            lambda role: {k: v.clone() for k, v in role.trainer.critic.model.state_dict().items()}
        ),
        timeout=60,
    )


def test_world_size_2_trains_the_critic_like_world_size_1(cfg, group, tmp_path):
    from relax.core.trainers.torch_trainer import trainer_from_context

    single = trainer_from_context(plugin_params(cfg, "trainer"), trainer_context(cfg, cfg.model.path))
    leader, peer = group.handles
    batch = ppo_batch(cfg.model.path)
    values = ray.get(leader.forward_values.remote(batch))
    torch.testing.assert_close(values, single.forward_values(batch), rtol=0, atol=1e-6)
    batch["values"] = values + 0.1 * batch["response_mask"]  # a non-zero start, so value clipping has work
    before = {k: v.clone() for k, v in single.critic.model.state_dict().items()}
    for step in range(2):  # warm-up (critic only), then both; the second also checks the AdamW moments agree
        got, want = ray.get(leader.train_step.remote(batch)), single.train_step(batch)
        for key in (*CRITIC_METRICS, "actor_updated"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
    assert got["actor_updated"] == 1.0
    expected, w0, w1 = single.critic.model.state_dict(), critic_weights(leader), critic_weights(peer)
    assert sum(float((expected[k] - before[k]).norm()) for k in before) > 1e-3, (
        "the critic did not move: vacuous"
    )
    for name, ref in expected.items():
        assert torch.equal(w0[name], w1[name]), f"critic replicas diverged on {name}"
        torch.testing.assert_close(w0[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # the checkpoint is rank 0's critic; every rank loads it
    ray.get(leader.save.remote(str(tmp_path / "ckpt")))
    ray.get(leader.train_step.remote(batch))
    ray.get(leader.load.remote(str(tmp_path / "ckpt")))
    for weights in (critic_weights(leader), critic_weights(peer)):
        assert all(torch.equal(weights[k], v) for k, v in w0.items())


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_relax_validate_takes_a_critic_at_any_world_size_and_names_what_the_backend_refuses(backend):
    """The HF backends train a critic at every world size (the PPO recipe's torch world_size 4 included); what
    they still refuse at start-up, relax validate refuses first (megatron's critic: relax-megatron's tests)."""
    from relax.core.config import ConfigError

    critic = [
        f"trainer.backend={backend}",
        "algorithm.advantage_estimator=gae",
        "algorithm.critic.enable=true",
    ]
    for world in (1, 2, 4):
        cfg = load_config(None, [*critic, f"trainer.backend_params={{world_size: {world}}}"])
        assert cfg.algorithm.critic.enable and cfg.trainer.backend_params.world_size == world
    with pytest.raises(ConfigError, match=r"trainer\.recompute: 'selective' is megatron's"):
        load_config(None, [*critic, "trainer.recompute=selective"])
