"""The fsdp trainer on CUDA (one GPU, NCCL world of one): bf16 compute over fp32 masters keeps an RL
learning rate's update, logprobs agree with fp32 on the same weights, and weight export hands the
transports CUDA tensors in bf16. Skipped with a reason on CPU; ``scripts/gpu_check.sh`` runs it."""

from __future__ import annotations

import pytest
import torch

from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples
from relax.core.trainers.fsdp.params import FSDPParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def cuda_trainer(model_dir: str, dtype: str, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        params=FSDPParams(device="cuda"),
        dtype=dtype,
        micro_batch_size=4,
        **kw,
    )


def test_bf16_on_cuda_moves_the_weights_at_lr_1e_6_and_exports_cuda_bf16(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=8, seed=1), tok.pad_token_id)
    changed, logprobs = {}, {}
    for dtype in ("float32", "bfloat16"):
        t = cuda_trainer(model_dir, dtype, lr=1e-6)
        try:
            logprobs[dtype] = t.forward_logprobs(batch)
            before = {n: p.detach().full_tensor().clone() for n, p in t.model.named_parameters()}
            for _ in range(10):
                t.train_step(dict(batch))
            after = {n: p.detach().full_tensor() for n, p in t.model.named_parameters()}
            changed[dtype] = sum(int((after[n] != before[n]).sum()) for n in before) / sum(
                v.numel() for v in before.values()
            )
            tensors = [x for b in t.export_weights() for _, x in b]
            assert {x.device.type for x in tensors} == {"cuda"} and {x.dtype for x in tensors} == {
                getattr(torch, dtype)
            }
        finally:
            t.close()
    assert changed["bfloat16"] == pytest.approx(changed["float32"], abs=0.03), changed
    mask = batch["response_mask"] > 0
    assert (logprobs["bfloat16"][mask] - logprobs["float32"][mask]).abs().max() < 0.1


def test_lora_on_cuda_takes_the_torch_trainers_step_and_exports_cuda_bf16_adapters(tmp_path):
    """bf16 base, fp32 adapters, one NCCL rank: the torch trainer's LoRA step (same kernels on the same
    bf16 base, so tolerances are bf16 rounding's), and an adapter-only export on the GPU."""
    from transformers import AutoTokenizer

    from relax.core.config import LoraConfig
    from relax.core.testing import torch_trainer
    from relax.core.testing.trainer import exported

    model_dir = build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=8, seed=1), tok.pad_token_id)
    lora = LoraConfig(rank=4, alpha=8.0)
    ref = torch_trainer(model_dir, lora=lora, dtype="bfloat16", device="cuda", micro_batch_size=4, lr=1e-3)
    want, want_w = ref.train_step(dict(batch)), exported(ref)
    t = cuda_trainer(model_dir, "bfloat16", lora=lora, lr=1e-3)
    try:
        got = t.train_step(dict(batch))
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2)
        tensors = [(n, x) for b in t.export_weights() for n, x in b]
        assert {x.device.type for _, x in tensors} == {"cuda"} and {x.dtype for _, x in tensors} == {
            torch.bfloat16
        }
        got_w = {n: x.cpu() for n, x in tensors}
        assert got_w.keys() == want_w.keys() and all(".lora_" in n for n in got_w)
        for name, tensor in got_w.items():
            torch.testing.assert_close(
                tensor.float(), want_w[name].float(), atol=2e-3, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
        t.save_hf(str(tmp_path / "final"))
        assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    finally:
        t.close()


def test_lora_modules_to_save_move_at_lr_1e_6_on_cuda_bf16(tmp_path):
    """The modules_to_save copies (every RMSNorm) are fp32 masters on both trainers on CUDA (fused AdamW there):
    at lr 1e-6 nearly every element moves, which a bf16 copy (spacing 2^-7 near 1.0) could not."""
    from transformers import AutoTokenizer

    from relax.core.config import LoraConfig
    from relax.core.testing import torch_trainer

    model_dir = build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=8, seed=1), tok.pad_token_id)
    lora = LoraConfig(rank=4, alpha=8.0, modules_to_save=["norm"])
    for backend in ("torch", "fsdp"):
        t = (
            torch_trainer(model_dir, lora=lora, dtype="bfloat16", device="cuda", micro_batch_size=4, lr=1e-6)
            if backend == "torch"
            else cuda_trainer(model_dir, "bfloat16", lora=lora, lr=1e-6)
        )

        def copies(t=t):
            return {
                n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                for n, p in t.model.named_parameters()
                if ".modules_to_save." in n
            }

        try:
            before = copies()
            assert before and {x.dtype for x in before.values()} == {torch.float32}, backend
            t.train_step(dict(batch))
            after = copies()
            moved = sum(int((after[n] != before[n]).sum()) for n in before) / sum(
                x.numel() for x in before.values()
            )
            assert moved > 0.9, (backend, moved)
        finally:
            if hasattr(t, "close"):
                t.close()


def test_a_ppo_critic_trains_on_cuda_with_fp32_masters(tmp_path):
    """The critic on CUDA (fsdp trainer, bf16 compute, NCCL world of one): values come back as host fp32, its
    weights stay fp32 and an update at lr 1e-6 moves them. (Its data-parallel sums at world 2 are tested on
    CPU over gloo: fsdp/test_fsdp_critic.py.)"""
    from transformers import AutoTokenizer

    from relax.core.trainers.critic import Critic

    model_dir = build_tiny_model(tmp_path / "m", seed=1, initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tok, rows=8, seed=1), tok.pad_token_id)
    mask = batch["response_mask"]
    t = cuda_trainer(
        model_dir,
        "bfloat16",
        lr=1e-6,
        critic=lambda device, sums: Critic(
            model_dir, lr=1e-6, dtype="bfloat16", device=device, data_parallel=sums
        ),
    )
    try:
        critic = t.critic
        assert critic.device.type == "cuda" and {p.dtype for p in critic.model.parameters()} == {
            torch.float32
        }
        with torch.no_grad():  # a head that is not zero, so the backbone gets gradients in the first update
            critic.model.head.weight.normal_(0.0, 0.1)
        values = t.forward_values(batch)
        assert values.device.type == "cpu" and values.dtype == torch.float32 and values.shape == mask.shape
        norms = {
            n: p.detach().clone() for n, p in critic.model.named_parameters() if n.endswith("norm.weight")
        }
        batch = {
            **batch,
            "values": values,
            "returns": torch.linspace(-1.0, 1.0, mask.shape[0])[:, None] * mask,
        }
        metrics = t.train_step(batch)
        assert metrics["critic_grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["vf_loss"]))
        after = dict(critic.model.named_parameters())
        moved = sum(int((after[n] != v).sum()) for n, v in norms.items()) / sum(
            v.numel() for v in norms.values()
        )
        assert moved > 0.9, moved
    finally:
        t.close()
