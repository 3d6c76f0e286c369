"""MoE routing replay (R3) on the megatron trainer, in one process (relax.megatron.routing, docs/moe.md).

The rollout's routing is the unperturbed tiny Qwen3-MoE's; the trainers load a copy whose routers were perturbed
(conftest's ``r3_*`` fixtures); core's torch trainer replaying the same routing is the reference. DP=2 x EP=2
and PP=2 run in test_tensor_parallel.py's two-process launch."""

from __future__ import annotations

import pytest
import torch

from relax.core.config import config_from_dict

KW = {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 4}  # conftest's R3_KW: the torch reference's settings


def _without_routing(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "routed_experts"}


def megatron_trainer(model_dir: str, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), **{**KW, **kw})


def test_routing_replay_is_accepted_at_validation():
    for mode in ("rollout", "reference"):
        cfg = config_from_dict({"trainer": {"backend": "megatron"}, "algorithm": {"routing_replay": mode}})
        assert cfg.algorithm.routing_replay == mode


def test_token_layout_follows_the_right_padded_rows():
    """Megatron's routers see (S, B) tokens, sequence-major, of rows rotated to right padding."""
    from relax.megatron.routing import token_routing

    routed = torch.arange(2 * 3, dtype=torch.int8).view(2, 3, 1, 1)  # row 0 has one leading pad
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert token_routing(routed, mask)[:, 0, 0].tolist() == [1, 3, 2, 4, 0, 5]


def test_replay_matches_the_torch_trainer_and_own_routing_does_not(
    megatron_world, r3_perturbed_dir, r3_batch, r3_torch, assert_r3_step
):
    """TP=PP=1: with replay, megatron's logprobs are the torch trainer's replaying the same routing (1e-5) and
    far from its own routing's; the replayed step (old logprobs, loss, router gradient through the replayed
    weights) and the routing metrics are the torch trainer's."""
    batch = r3_batch
    assert batch["routed_experts"].dtype == torch.int8 and bool(
        batch["attention_mask"].eq(0).any()
    )  # left pads
    meg = megatron_trainer(r3_perturbed_dir, routing_replay=True)
    free, replayed = meg.forward_logprobs(_without_routing(batch)), meg.forward_logprobs(batch)
    torch.testing.assert_close(replayed, r3_torch["replayed"], atol=1e-5, rtol=0)
    torch.testing.assert_close(free, r3_torch["free"], atol=1e-5, rtol=0)
    assert (
        float((free - replayed).abs().max()) > 0.05
    )  # the perturbation moved tokens: the check is not vacuous
    got = {
        "metrics": meg.train_step(batch),
        "weights": {n: t for b in meg.export_weights(1 << 16) for n, t in b},
    }
    metrics = got["metrics"]
    assert metrics["routing/mismatch_frac_free"] > 0
    assert metrics["routing/logprob_diff_replay"] < metrics["routing/logprob_diff_free"]
    assert_r3_step(got)


def test_a_frozen_reference_replays_and_a_non_replaying_one_ignores_the_routing(
    megatron_world, r3_perturbed_dir, r3_batch, r3_torch
):
    """``routing_replay: reference``: the frozen reference replays too; ``rollout`` leaves it its own routing.
    A batch recorded on another model (other MoE layer count) is an error naming the column."""
    reference = megatron_trainer(r3_perturbed_dir, trainable=False, routing_replay=True)
    torch.testing.assert_close(reference.forward_logprobs(r3_batch), r3_torch["replayed"], atol=1e-5, rtol=0)
    with pytest.raises(
        ValueError, match=r"routed_experts \(4, \d+, 1, 2\) should be \(rows, tokens, 2 MoE layers"
    ):
        reference.forward_logprobs({**r3_batch, "routed_experts": r3_batch["routed_experts"][:, :, :1]})
    own = megatron_trainer(r3_perturbed_dir, trainable=False, routing_replay=False)
    torch.testing.assert_close(own.forward_logprobs(r3_batch), r3_torch["free"], atol=1e-5, rtol=0)


def test_sequence_slice_pads_with_unrecorded_tokens_and_splits():
    """Sequence parallelism: a TP rank's routers see its slice of the sequence-major tokens, the sequence
    padded (as the trainer pads it) with unrecorded (-1) ids."""
    from relax.megatron.routing import sequence_slice

    tokens = torch.arange(6)[:, None, None]  # S=3 positions x B=2 rows, sequence-major
    assert sequence_slice(tokens, 2, 2, 0).flatten().tolist() == [0, 1, 2, 3]
    assert sequence_slice(tokens, 2, 2, 1).flatten().tolist() == [4, 5, -1, -1]
    assert sequence_slice(tokens[:4], 2, 2, 1).flatten().tolist() == [2, 3]  # S=2: no padding
