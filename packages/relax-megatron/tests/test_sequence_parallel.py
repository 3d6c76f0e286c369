"""Sequence parallelism across pipeline stages: MoE at TP > 1 needs it, and at TP=2 x PP=2 each stage sends the
next its TP rank's slice of the sequence. Four real processes over gloo (``tp_worker.py``), one launch;
the TP=2-only checks are in test_tensor_parallel.py (another launch)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sp_pp(run_ranks, tiny_qwen3, tiny_qwen3_moe, moe_tp_batch, omni_moe_tp):
    """One four-process launch: Qwen3-MoE and the Qwen3-Omni thinker at TP=2 x PP=2, sequence parallelism across
    the stages (each stage sends the next its TP rank's slice of the sequence, padded to a multiple of TP)."""
    return run_ranks(
        "sp_pp", tiny_qwen3[0], {"moe": (tiny_qwen3_moe[0], moe_tp_batch), "omni_moe": omni_moe_tp}, world=4
    )


@pytest.mark.parametrize("name", ["moe", "omni_moe"])
def test_tp2_pp2_moe_with_sequence_parallelism_matches_the_torch_trainer(
    sp_pp, name, tiny_qwen3_moe, moe_tp_batch, omni_moe_tp, torch_step
):
    """MoE at TP > 1 needs sequence parallelism; with PP=2 too (an odd sequence; the Omni thinker on image, video,
    audio and text rows, later stages computing their M-RoPE positions): the torch trainer's logprobs and step
    (loss, entropy, grad norm; weights within AdamW's first-step 2e-4, experts gathered over both stages)."""
    got = sp_pp[name]
    model_dir, batch = (tiny_qwen3_moe[0], moe_tp_batch) if name == "moe" else omni_moe_tp
    want = torch_step.media_step_reference(got, model_dir, batch)
    torch_step.assert_same_weights(torch_step.fused(got["weights"]), want)
