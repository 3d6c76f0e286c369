"""The fsdp trainer at world size 2 over NCCL (two Ray rank actors, one GPU each) against world size 1 on one
GPU: the same logprobs (the scoring all-gather runs into CUDA tensors over NCCL), the same loss and gradient
norm, the same updated weights, exported as CUDA tensors. Needs two GPUs; ``scripts/gpu_check.sh`` runs it in
its 2-GPU mode. The CPU tests of the same step run over gloo (``test_fsdp_ranks.py``)."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples
from relax.core.testing.trainer import exported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL at world 2 needs 2 CUDA GPUs (one per rank)"
    ),
]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks build their trainers from here

KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4}


def build(model_dir: str, rank: int = 0, world: int = 1, port: int | None = None):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(device="cuda", world_size=world),
        dtype="float32",
        master_addr="127.0.0.1" if port else None,
        master_port=port,
        **KW,
    )


@ray.remote(num_gpus=1, num_cpus=0)
class CudaRank:
    def __init__(self, model_dir: str, rank: int, port: int) -> None:
        self.trainer = build(model_dir, rank, 2, port)

    def call(self, method: str, *args):
        return getattr(self.trainer, method)(*args)

    def export(self):
        if self.trainer.rank:
            return sum(1 for _ in self.trainer.export_weights())
        devices = {t.device.type for b in self.trainer.export_weights() for _, t in b}
        return devices, {n: t.cpu() for n, t in exported(self.trainer).items()}

    def close(self) -> None:
        self.trainer.close()


def test_world_2_over_nccl_takes_the_step_world_1_takes(ray_local, tmp_path):
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "m", seed=4, initializer_range=0.2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    single = build(model_dir)
    try:
        want_lp = single.forward_logprobs(batch)
        want = single.train_step(dict(batch))
        want_w = {n: t.cpu() for n, t in exported(single).items()}
    finally:
        single.close()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [CudaRank.remote(model_dir, r, port) for r in range(2)]
    try:

        def both(method, *args):
            return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=600)[0]

        torch.testing.assert_close(both("call", "forward_logprobs", batch), want_lp, atol=1e-5, rtol=0)
        got = both("call", "train_step", dict(batch))
        for key in ("loss", "entropy", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
        devices, got_w = both("export")
        assert devices == {"cuda"} and got_w.keys() == want_w.keys()
        for name, tensor in got_w.items():
            torch.testing.assert_close(
                tensor, want_w[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
    finally:
        ray.get([r.close.remote() for r in ranks], timeout=120)
        for r in ranks:
            ray.kill(r)
