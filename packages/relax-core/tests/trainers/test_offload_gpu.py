"""``trainer.offload`` on CUDA (one GPU): after the update the optimizer state leaves the GPU, after the sync the
parameters do, and the CUDA allocator then holds less by what moved, with its cache handed back; the state comes
back bit for bit. The torch trainer (fused AdamW, bf16 autocast over fp32 masters) and the fsdp trainer (NCCL world
of one, DTensor shards). Skipped with a reason on CPU; ``scripts/gpu_check.sh`` runs it."""

from __future__ import annotations

import pytest
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples, torch_trainer
from relax.core.trainers.offload import PARTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

KW = {"lr": 1e-3, "micro_batch_size": 4}


def fsdp_cuda(model_dir: str):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        params=FSDPParams(device="cuda"),
        dtype="bfloat16",
        **KW,
    )


def cuda_state(trainer) -> list[torch.Tensor]:
    params = list(trainer.model.parameters())
    state = [v for p in params for v in trainer.optimizer.state[p].values() if torch.is_tensor(v)]
    return [getattr(t, "_local_tensor", t) for t in params + state]


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_cuda_memory_drops_by_what_was_offloaded_and_comes_back_bit_identical(backend, tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=1, hidden_size=256, intermediate_size=1024)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=8, seed=1), tok.pad_token_id)
    trainer = (
        torch_trainer(model_dir, dtype="bfloat16", device="cuda", **KW)
        if backend == "torch"
        else fsdp_cuda(model_dir)
    )
    try:
        trainer.train_step(dict(batch))
        before = [t.clone() for t in cuda_state(trainer)]
        assert all(t.is_cuda for t in before)
        optimizer = trainer.offload(("grads", "optimizer"))  # after the update: the engines resume next
        assert optimizer["moved_gb"] > 0
        dropped = optimizer["before"]["mem_gb"] - optimizer["after"]["mem_gb"]
        assert dropped >= 0.9 * optimizer["moved_gb"], optimizer
        assert (
            optimizer["after"]["mem_reserved_gb"] < optimizer["before"]["mem_reserved_gb"]
        )  # the cache went back
        params = trainer.offload(PARTS)  # after the sync
        assert params["before"]["mem_gb"] - params["after"]["mem_gb"] >= 0.9 * params["moved_gb"] > 0, params
        assert not any(t.is_cuda for t in cuda_state(trainer))
        back = trainer.onload()
        assert back["after"]["mem_gb"] >= params["before"]["mem_gb"] - 0.01
        after = cuda_state(trainer)
        assert all(t.is_cuda for t in after)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert torch.isfinite(torch.tensor(trainer.train_step(dict(batch))["loss"]))  # trains on from there
    finally:
        if hasattr(trainer, "close"):
            trainer.close()
