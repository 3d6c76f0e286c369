"""GPU paths: skipped with a reason on CPU machines, run where CUDA is present.

What runs on CPU elsewhere in the suite is repeated here on the accelerator: the HF engine and the
torch trainer agree on logprobs on CUDA, a colocate run learns on CUDA, and NCCL weight broadcast
delivers bit-identical tensors (this one needs two GPUs: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import build_tiny_model
from relax.core.trainers.torch_trainer import TorchTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def test_engine_and_trainer_logprobs_agree_on_cuda(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3)
    engine = HFRolloutEngine(path, device="cuda")
    trainer = TorchTrainer(path, device="cuda")
    prompts = [[1, 4, 23, 10, 17], [10, 17, 11, 20], [7]]
    requests = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=12, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    results = asyncio.run(engine.generate(requests))
    samples = [
        Sample(prompt_ids=p, group_id=i, response_ids=r.response_ids)
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    trainer_lp = trainer.forward_logprobs(collate(samples, 0)).cpu()
    for i, r in enumerate(results):
        assert torch.allclose(torch.tensor(r.logprobs), trainer_lp[i, : len(r.logprobs)], atol=1e-3)


def test_hf_engine_releases_its_gpu_memory_and_resumes_exactly(tmp_path):
    """``rollout.release_memory`` on the HF engine: its weights leave the GPU and come back unchanged."""
    engine = HFRolloutEngine(build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3), device="cuda")
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    requests = [GenerationRequest("r", [1, 4, 23], SamplingParams(max_new_tokens=8, seed=3, ignore_eos=True))]
    before = asyncio.run(engine.generate(requests))[0]
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    assert held - torch.cuda.memory_allocated() >= weights
    engine.resume_memory()
    after = asyncio.run(engine.generate(requests))[0]
    assert after.response_ids == before.response_ids and after.logprobs == before.logprobs


def test_colocate_quickstart_learns_on_cuda(ray_session, tmp_path):
    from relax.core.config import load_config
    from relax.core.controller.run import run

    run_dir = tmp_path / "gpu"
    run(
        load_config(
            None,
            [
                "total_steps=30",
                f"run_dir={run_dir}",
                "trainer.backend_params={device: cuda}",
                "rollout.engine_params={device: cuda}",
                "logging.progress=false",
                "checkpoint.resume=never",
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["reward/mean"] for r in rows[-5:]) / 5 > sum(r["reward/mean"] for r in rows[:5]) / 5 + 0.15


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs 2 CUDA GPUs (one per rank)")
def test_nccl_broadcast_is_bit_identical(ray_session):
    """The driver process is the trainer (rank 0, one GPU); an engine actor on the other GPU receives."""
    import ray

    from relax.core.weight_sync import BroadcastSync, serve_receiver

    class Engine:
        def __init__(self):
            self.state, self.version = {}, 0

        def update_weights(self, named, version):
            self.state.update({n: t.cpu().clone() for n, t in named})
            self.version = version

        def weight_version(self):
            return self.version

    @ray.remote(num_gpus=1)
    class EngineHost:  # as RolloutRole: hosts the engine and the weight-sync receive endpoint
        def __init__(self):
            self.engine = Engine()

        def weight_receiver(self, spec, method, *args):
            return serve_receiver(self, self.engine, spec, method, *args)

        def get(self):
            return self.engine.state

        def gpu(self):
            return int(ray.get_gpu_ids()[0])

    class Trainer:
        def __init__(self):  # small CPU tensors are staged on the GPU; the large CUDA one is sent directly
            self.state = {
                "a": torch.randn(1000, 33),
                "b": torch.randn(7).to(torch.bfloat16),
                "c": torch.randn(700, 600, device="cuda"),
            }

        def export_weights(self, bucket_bytes):
            yield list(self.state.items())

    receiver = EngineHost.remote()
    torch.cuda.set_device(1 if ray.get(receiver.gpu.remote()) == 0 else 0)  # one GPU per NCCL rank
    trainer = Trainer()
    BroadcastSync(timeout_s=120, bucket_bytes=1 << 20, backend="nccl").sync(trainer, [receiver], 3)
    got = ray.get(receiver.get.remote())
    assert all(torch.equal(got[n], t.cpu()) for n, t in trainer.state.items())
