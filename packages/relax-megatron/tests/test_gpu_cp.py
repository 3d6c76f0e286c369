"""Megatron context parallelism on two GPUs with Transformer Engine: the trainer at context_parallel = 2 scores a
batch and takes a step as it does at context_parallel = 1 (the same TE layer spec, bf16: TE's attention under CP
needs flash or fused attention, which take half precision only). Skipped with a reason anywhere else; listed by
``scripts/gpu_check.sh`` (its 2-GPU rows). Not yet run on a device: the tolerances are first estimates (bf16
keeps ~3 significant digits), to be confirmed by the first ``gpu_check`` on two GPUs.

The CPU side (``test_context_parallel.py``) checks the split, the score gather and the gradient sum over gloo with
a per-token stand-in for the model; this file is where the attention itself (TE's ring, ``cp_comm_type: p2p``)
and megatron's CP-aware rotary positions meet them."""

from __future__ import annotations

import pytest
import torch

from relax.core.testing import make_batch, make_samples
from relax.megatron.layer_specs import transformer_engine_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not transformer_engine_available(),
        reason="needs 2 CUDA GPUs and Transformer Engine (transformer_engine.pytorch importable, built for "
        "this torch: docs/gpu.md#transformer-engine): megatron's context parallelism runs in TE's attention",
    ),
]


@pytest.fixture(scope="module")
def batch(tiny_qwen3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    return make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)


def test_cp2_logprobs_and_one_step_equal_cp1(run_ranks, tiny_qwen3, batch):
    """CP 2 (each rank two of four chunks of every row, TE's ring attention, scores gathered, gradients summed
    over DP x CP) against CP 1 on one GPU: logprobs, the step's loss and gradient norm, and the weights after it."""
    model_dir, bf16 = tiny_qwen3[0], ("--dtype", "bfloat16")
    alone = run_ranks("cp", model_dir, {"batch": batch}, *bf16, world=1, script="gpu_worker.py")
    split = run_ranks("cp", model_dir, {"batch": batch}, *bf16, world=2, script="gpu_worker.py")
    mask = batch["response_mask"] > 0
    diff = (split["logprobs"] - alone["logprobs"]).abs()[mask]
    assert float(diff.max()) < 0.1 and float(diff.mean()) < 0.01, (float(diff.max()), float(diff.mean()))
    assert split["metrics"]["loss"] == pytest.approx(alone["metrics"]["loss"], rel=0.02, abs=1e-3)
    # a CP rank's gradient alone is its tokens' share: without the sum over DP x CP the norm would be far off
    assert split["metrics"]["grad_norm"] == pytest.approx(alone["metrics"]["grad_norm"], rel=0.03)
    assert sorted(split["weights"]) == sorted(alone["weights"])
    moved = [(split["weights"][n] - t).abs().mean() for n, t in alone["weights"].items()]
    assert float(torch.stack(moved).max()) < 2e-3  # Adam's first step is ~lr = 1e-2 per weight: the same step
