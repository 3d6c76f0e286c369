"""Each ``sglang_*`` transport moves the torch trainer's weights into the session's SGLang server: outputs
become exactly the new weights' (core's HF engine on them is the reference) and the server reports the new
version. The trainer is built on the other tiny model; every test syncs back to the original weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import WeightSyncConformance, torch_trainer
from relax.sglang.server import free_port
from relax.sglang.testing import load_weights
from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

PROMPTS = [[4, 5, 6], [7, 8, 9, 10], [12, 3]]


def _greedy(engine) -> list:
    reqs = [
        GenerationRequest(f"t{i}", p, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
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


class _OnSharedServer(WeightSyncConformance):
    """The kit with the session's server as its one engine. A dead engine is simulated by pointing the
    engine's client at a closed port (killing the shared server would cost the rest of the session a
    relaunch); teardown reconnects it and restores the original weights."""

    num_engines = 1
    timeout_s = 10.0

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _engine(cls, sglang_engine, tiny_dirs):
        cls.engine, cls.original = sglang_engine, tiny_dirs[0]
        cls.url = sglang_engine.client.url

    def make_receiver_engine(self, model_dir, index):
        return self.engine

    def served_weights(self, engine):
        pytest.skip(
            "SGLang 0.5.23 cannot return a Qwen3 model's weights by name (get_weights_by_name: 'TODO: Add "
            "support for Qwen models'); test_transport_serves_exactly_the_new_weights_and_version checks "
            "the served weights through exact greedy outputs and logprobs instead"
        )

    def break_engine(self, engine, release):
        engine.client.url = f"http://127.0.0.1:{free_port()}"

    def close(self, obj):
        if obj is self.engine:
            obj.client.url = self.url
            load_weights(obj, self.original, obj.weight_version() + 1)


class TestSGLangDiskConformance(_OnSharedServer):
    def make_transport(self, timeout_s, bucket_bytes):
        return SGLangDiskSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class TestSGLangTensorConformance(_OnSharedServer):
    def make_transport(self, timeout_s, bucket_bytes):
        return SGLangTensorSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class TestSGLangDistributedConformance(_OnSharedServer):
    def make_transport(self, timeout_s, bucket_bytes):
        return SGLangDistributedSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes, backend="gloo")
