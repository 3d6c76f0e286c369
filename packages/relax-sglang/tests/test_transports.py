"""Each ``sglang_*`` transport moves the torch trainer's weights into the session's SGLang server: outputs
become exactly the new weights' (core's HF engine on them is the reference) and the server reports the new
version. The trainer is built on the other tiny model; every test syncs back to the original weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import torch_trainer
from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

PROMPTS = [[4, 5, 6], [7, 8, 9, 10], [12, 3]]


def _greedy(engine) -> list:
    reqs = [GenerationRequest(f"t{i}", p, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    return asyncio.run(asyncio.wait_for(engine.generate(reqs), 300))


@pytest.fixture(scope="module")
def trainers(tiny_dirs):
    return {"other": torch_trainer(tiny_dirs[1]), "same": torch_trainer(tiny_dirs[0])}


@pytest.fixture(scope="module")
def expected(tiny_dirs):
    return _greedy(HFRolloutEngine(tiny_dirs[1])), _greedy(HFRolloutEngine(tiny_dirs[0]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGLangDiskSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangTensorSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangDistributedSync(timeout_s=120, bucket_bytes=1 << 18, backend="gloo"),
    ],
    ids=["sglang_disk", "sglang_tensor", "sglang_distributed"],
)
def test_transport_serves_exactly_the_new_weights_and_version(make, sglang_engine, trainers, expected):
    transport = make()
    transport.check_engine("sglang")
    with pytest.raises(Exception, match="cannot serve rollout.engine 'hf'"):
        transport.check_engine("hf")
    new, old = expected
    version = sglang_engine.weight_version() + 1
    try:
        stats = transport.sync(trainers["other"], [sglang_engine], version)
        assert stats["buckets"] >= 2 and stats["bytes"] > 0, stats
        assert sglang_engine.weight_version() == version
        after = _greedy(sglang_engine)
        for got, want in zip(after, new, strict=True):
            assert got.response_ids == want.response_ids, "the server does not serve the trainer's weights"
            torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
            assert got.versions == [version] * 6, got.versions
    finally:
        transport.sync(trainers["same"], [sglang_engine], version + 1)
        transport.close()
    restored = _greedy(sglang_engine)
    assert [r.response_ids for r in restored] == [r.response_ids for r in old]
    assert sglang_engine.health()["weight_version"] == version + 1
