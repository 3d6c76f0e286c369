"""Torch trainer data parallelism through real Ray rank actors and gloo: world_size 2 gives the same
update as world_size 1 on the same batch, and a dead rank is named."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.contexts import plugin_params, trainer_context
from relax.core.data import Sample, collate
from relax.core.policy_update import shard_bounds
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing.trainer import learning_metrics
from relax.core.trainers.torch_trainer import trainer_from_context


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("dp-model"), seed=3, initializer_range=0.2)
    return load_config(
        None,
        [
            f"model.path={path}",
            f"run_dir={tmp_path_factory.mktemp('dp-run')}",
            "trainer.lr=0.001",
            "rollout.prompts_per_step=3",
            "rollout.n_samples_per_prompt=2",
            "trainer.micro_batch_size=2",
            "trainer.num_minibatches=3",
            "trainer.grad_clip=0.5",
            "algorithm.entropy_coef=0.01",
            "trainer.backend_params={world_size: 2, num_cpus: 0.5}",
        ],
    )


def make_batch(rows: int = 5) -> dict[str, torch.Tensor]:
    """Rows of different prompt/response lengths; 3 mini-batches of 2, 2, 1 rows, so rank 0 has no
    row in the last one (it joins the collectives with a masked row)."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        prompt = torch.randint(4, 24, (3 + i % 3,), generator=gen).tolist()
        response = torch.randint(4, 24, (2 + (i * 3) % 5,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=prompt, group_id=i // 2, response_ids=response))
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=gen) * batch["response_mask"]
    return batch


def _state(handle) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ray.get(handle.call.remote("state_dict_for_sync")).items()}


def test_shards_cover_every_row_once():
    for rows in range(7):
        bounds = [shard_bounds(rows, r, 3) for r in range(3)]
        assert [i for s, e in bounds for i in range(s, e)] == list(range(rows))


def test_world_size_2_scores_sum_pi_squared_like_world_size_1(cfg, group):
    """Runs before any update on the group: the ranks still hold the initial weights."""
    single = trainer_from_context(plugin_params(cfg, "trainer"), trainer_context(cfg, cfg.model.path))
    batch = make_batch()
    lp_dp, spi_dp = ray.get(group.handles[0].forward_logprobs_and_sum_pi_squared.remote(batch))
    lp_single, spi_single = single.forward_logprobs_and_sum_pi_squared(batch)
    torch.testing.assert_close(spi_dp, spi_single, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp_dp, lp_single, rtol=1e-6, atol=1e-6)
    mask = batch["response_mask"] > 0
    assert spi_dp.shape == mask.shape and (spi_dp[mask] > 0).all() and (spi_dp[~mask] == 0).all()


def test_world_size_2_gives_the_same_update_as_world_size_1(cfg, group):
    single = trainer_from_context(plugin_params(cfg, "trainer"), trainer_context(cfg, cfg.model.path))
    batch = make_batch()
    leader, peer = group.handles
    before = _state(leader)
    assert all(torch.equal(before[k], v) for k, v in single.state_dict_for_sync().items())

    lp_dp = ray.get(leader.forward_logprobs.remote(batch))
    lp_single = single.forward_logprobs(batch)
    torch.testing.assert_close(lp_dp, lp_single, rtol=1e-6, atol=1e-6)

    for _ in range(2):  # the second step also checks the optimizer state (AdamW moments) stayed equal
        m_dp = learning_metrics(ray.get(leader.train_step.remote(batch)))
        m_single = learning_metrics(single.train_step(batch))
        assert m_dp.keys() == m_single.keys()
        for key, value in m_single.items():  # loss, grad_norm, entropy, the objective's metrics, lr
            assert m_dp[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key

    after0, after1 = _state(leader), _state(peer)
    expected = single.state_dict_for_sync()
    moved = sum(float((expected[k] - before[k]).norm()) for k in before)
    assert moved > 1e-3, "the step did not change the weights: the comparison would be vacuous"
    for name, ref in expected.items():
        assert torch.equal(after0[name], after1[name]), f"ranks diverged on {name}"
        err = float((after0[name] - ref).norm())
        assert err <= 1e-6 * float(ref.norm()) + 1e-9, (name, err)
        update_err = err / max(float((ref - before[name]).norm()), 1e-12)
        assert update_err < 1e-4, (name, update_err)  # the update itself, not just the weights, agrees

    # after two steps the weights differ by float summation order only (as between two micro-batch
    # sizes at world_size 1: ~6e-6 on these logprobs), so the logprobs agree to that level
    torch.testing.assert_close(
        ray.get(leader.forward_logprobs.remote(batch)), single.forward_logprobs(batch), rtol=0, atol=5e-5
    )


def test_checkpoint_is_written_by_rank_0_and_loaded_by_every_rank(cfg, group, tmp_path):
    leader, peer = group.handles
    saved = _state(leader)
    ray.get(leader.save.remote(str(tmp_path / "ckpt")))
    assert (tmp_path / "ckpt" / "trainer_state.pt").is_file()
    ray.get(leader.train_step.remote(make_batch()))
    assert any(not torch.equal(v, saved[k]) for k, v in _state(peer).items())
    ray.get(leader.load.remote(str(tmp_path / "ckpt")))
    for state in (_state(leader), _state(peer)):
        assert all(torch.equal(state[k], v) for k, v in saved.items())


def test_the_same_error_on_every_rank_keeps_the_group(group):
    """A bad batch fails identically on all ranks: the leader's own exception comes back and the
    ranks, still in step, keep working."""
    leader, _ = group.handles
    bad = {k: v for k, v in make_batch().items() if k != "advantages"}
    with pytest.raises(KeyError, match="advantages"):
        ray.get(leader.train_step.remote(bad), timeout=120)
    metrics = ray.get(leader.train_step.remote(make_batch()), timeout=120)
    assert metrics["grad_norm"] > 0


def test_a_dead_rank_is_named_and_the_group_stops(group):
    """Last in this module: it kills rank 1."""
    leader, peer = group.handles
    ray.kill(peer, no_restart=True)
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(leader.train_step.remote(make_batch()), timeout=120)
    assert "trainer rank 1 failed during train_step: actor died" in str(info.value)
    assert time.monotonic() - started < 60
    with pytest.raises(ray.exceptions.RayTaskError, match="worker group is stopped"):
        ray.get(leader.forward_logprobs.remote(make_batch()), timeout=60)
