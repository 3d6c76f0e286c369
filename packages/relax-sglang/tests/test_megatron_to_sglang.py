"""The megatron trainer's weights into the session's SGLang server, through each ``sglang_*`` transport.

One megatron trainer (relax-megatron, TP=1, in-process gloo world of one, CPU, float32) on the kit's tiny
Qwen3 takes one policy-gradient step; core's HF engine on the exported weights is the reference. Each
transport then syncs the trained weights into the shared server: greedy tokens and per-token logprobs equal
the reference's and every token carries the new version. The server gets its original weights back after
each test (the other tests of the session share it).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import make_batch, make_samples
from relax.core.testing.trainer import exported
from relax.sglang.testing import load_weights
from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

pytest.importorskip("megatron.core", reason="relax-megatron's megatron-core is not installed")

PROMPTS = [[4, 5, 6], [7, 8, 9, 10], [12, 3]]
NEW_TOKENS = 6


def _greedy(engine) -> list:
    reqs = [
        GenerationRequest(
            f"m{i}", p, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
        for i, p in enumerate(PROMPTS)
    ]
    return asyncio.run(asyncio.wait_for(engine.generate(reqs), 300))


@pytest.fixture(scope="module")
def trained(megatron_world, tiny_dirs):
    """(the megatron trainer after one step, the HF engine's greedy results on its exported weights, the
    HF engine's on the original weights)."""
    from transformers import AutoTokenizer

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    model_dir = tiny_dirs[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, micro_batch_size=4
    )
    batch = make_batch(make_samples(tokenizer, rows=8, seed=5), tokenizer.pad_token_id)
    trainer.train_step({**batch, "old_logprobs": trainer.forward_logprobs(batch)})
    reference = HFRolloutEngine(model_dir)
    before = _greedy(reference)
    reference.update_weights(exported(trainer), 1)
    return trainer, _greedy(reference), before


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGLangDiskSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangTensorSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangDistributedSync(timeout_s=120, bucket_bytes=1 << 18, backend="gloo"),
    ],
    ids=["sglang_disk", "sglang_tensor", "sglang_distributed"],
)
def test_megatron_weights_are_served_exactly(make, sglang_engine, trained, tiny_dirs):
    trainer, want, before = trained
    moved = max(
        abs(a - b)
        for r, o in zip(want, before, strict=True)
        for a, b in zip(r.logprobs, o.logprobs, strict=True)
    )
    assert moved > 1e-3, "the train step did not change the model's outputs: the comparison would be vacuous"
    transport = make()
    version = sglang_engine.weight_version() + 1
    try:
        stats = transport.sync(trainer, [sglang_engine], version)
        assert stats["buckets"] >= 2 and stats["bytes"] > 0, stats
        assert sglang_engine.weight_version() == version
        for got, ref in zip(_greedy(sglang_engine), want, strict=True):
            assert got.response_ids == ref.response_ids, (
                "the server does not serve the megatron trainer's weights"
            )
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0
            )
            assert got.versions == [version] * NEW_TOKENS, got.versions
    finally:
        transport.close()
        load_weights(sglang_engine, tiny_dirs[0], version + 1)  # the session's other tests expect these
    assert [r.response_ids for r in _greedy(sglang_engine)] == [r.response_ids for r in before]
