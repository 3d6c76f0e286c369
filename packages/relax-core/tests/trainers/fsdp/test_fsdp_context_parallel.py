"""Data x context parallelism on the fsdp trainer: the rank layout (pure), and a world of 4 Ray actor processes
(gloo) as 2 data-parallel replicas x 2 Ulysses ranks against world 1 (this process) on the same batch: the same
logprobs, critic values, loss, gradient norm, critic update and weights. World 2 with context_parallel 2 alone
is ``test_fsdp_ranks``' ``-ulysses`` variants."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples
from relax.core.testing.trainer import exported
from relax.core.trainers.fsdp.layout import Layout, layout_problem

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # build runs in the rank actors

KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4}  # as test_fsdp_ranks
# not vf_clip_frac: a strict ">" between the clipped and unclipped loss, which rounding flips where they are equal
CRITIC_METRICS = ("vf_loss", "values_mean", "critic_grad_norm")


def test_ranks_form_consecutive_cp_groups_and_strided_dp_groups():
    layouts = [Layout(r, 8, 2) for r in range(8)]
    assert [(x.dp_rank, x.cp_rank) for x in layouts[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[0].cp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layouts[0].dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [x.rank for x in layouts if x.answers] == [0, 2, 4, 6]  # CP rank 0 of every replica
    for x in layouts:  # each rank in exactly one group of each kind, the one its ranks say
        assert [g for g in x.cp_groups() if x.rank in g] == [x.cp_groups()[x.dp_rank]]
        assert [g for g in x.dp_groups() if x.rank in g] == [x.dp_groups()[x.cp_rank]]
        assert x.dp_size == 4 and x.cp_size == 2
    assert Layout(3, 4).dp_groups() == [[0, 1, 2, 3]] and Layout(3, 4).dp_rank == 3  # no CP: plain DP
    assert Layout(1, 4, 4).dp_size == 1 and Layout(1, 4, 4).cp_groups() == [[0, 1, 2, 3]]  # CP alone


def test_a_context_parallel_size_that_does_not_divide_the_world_is_named():
    assert layout_problem(6, 3) is None
    assert layout_problem(6, 4).startswith("context_parallel: must be >= 1 and divide world_size (6)")
    assert layout_problem(4, 0).endswith("got 0")
    with pytest.raises(ValueError, match=r"trainer\.backend_params\.context_parallel: .*world_size \(4\)"):
        Layout(0, 4, 3)


def build(model_dir: str, rank: int = 0, world: int = 1, port: int | None = None, **settings):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.critic import Critic
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    cp = settings.pop("context_parallel", 1)

    def critic(device, sums):
        return Critic(model_dir, lr=1e-3, eps=1e-4, micro_batch_size=2, device=device, data_parallel=sums)

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(world_size=world, context_parallel=cp),
        master_addr="127.0.0.1" if port else None,
        master_port=port,
        critic=critic,
        **KW,
        **settings,
    )


def critic_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.critic.model.state_dict().items()}


def build_dp2_cp2(model_dir: str, rank: int, world: int, port: int):
    """2 replicas x 2 Ulysses ranks, packed token-budget micro-batches (rows balanced over the replicas)."""
    return build(
        model_dir, rank, world, port, context_parallel=2, pack_sequences=True, max_tokens_per_micro_batch=12
    )


def test_dp2_x_cp2_takes_the_step_world_1_takes(world4, tmp_path):
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "m", seed=4, initializer_range=0.2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=7, seed=2), tok.pad_token_id)  # replica shares of 4 and 3 rows
    mask = batch["response_mask"]
    batch["returns"] = torch.linspace(-1.0, 1.0, mask.shape[0])[:, None] * mask
    single = build(model_dir)
    try:
        initial = exported(single)
        want_lp, want_values = single.forward_logprobs(batch), single.forward_values(batch)
        batch["values"] = want_values + 0.1 * mask
        want = single.train_step(dict(batch))
        want_w, want_critic = exported(single), critic_state(single)
    finally:
        single.close()
    world4.build(build_dp2_cp2, model_dir)
    assert ray.get([r.apply.remote(lambda t: (t.dp_rank, t.layout.cp_rank)) for r in world4.ranks]) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    torch.testing.assert_close(world4.call("forward_logprobs", batch), want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(world4.call("forward_values", batch), want_values, atol=1e-6, rtol=0)
    got = world4.call("train_step", dict(batch))
    for key in ("loss", "entropy", "grad_norm", *CRITIC_METRICS):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
    assert got["perf/micro_batches"] > 1  # the budget (12 tokens; rows of 5-12) split the replicas' rows
    got_w = world4.export()
    assert max(float((want_w[n] - initial[n]).abs().max()) for n in want_w) > 5e-4  # the step moved them
    for name, tensor in got_w.items():
        torch.testing.assert_close(tensor, want_w[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    for replica in ray.get([r.apply.remote(critic_state) for r in world4.ranks], timeout=120):
        for name, ref in want_critic.items():
            torch.testing.assert_close(
                replica[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
