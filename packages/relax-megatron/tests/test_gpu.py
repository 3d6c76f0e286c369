"""The megatron trainer on CUDA (NCCL, bf16, megatron's DistributedOptimizer): skipped with a reason on
CPU machines, run where CUDA is present. What the CPU tests check over gloo in float32 is repeated on the
device: logprobs equal HF transformers', a bf16 step trains, the distributed optimizer takes the same step
as the trainer's own AdamW path, and ``relax run`` of the megatron quick-start runs with ``device: cuda``.
Multi-rank checks need one GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from relax.core.testing import make_batch, make_samples, torch_trainer
from relax.core.testing.trainer import exported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: one per rank (NCCL refuses two ranks on one device)",
)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "quickstart_megatron.yaml"
BF16_ATOL = 0.1  # bf16 keeps ~3 significant digits: logprobs of a few nats move by a few 1e-2


@pytest.fixture(scope="module")
def batch(tiny_qwen3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    return make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)


def cuda_trainer(model_dir: str, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    kw = {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 4, **kw}
    return MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), device="cuda", **kw
    )


def test_logprobs_match_hf_in_fp32_and_bf16(cuda_world, tiny_qwen3, batch):
    model_dir = tiny_qwen3[0]
    reference = torch_trainer(model_dir).forward_logprobs(batch)  # HF transformers, fp32 on CPU
    fp32 = cuda_trainer(model_dir)
    assert next(fp32.model.parameters()).device.type == "cuda"
    got = fp32.forward_logprobs(batch)
    assert got.device.type == "cpu" and got.dtype == torch.float32  # results come back on CPU
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)
    bf16 = cuda_trainer(model_dir, dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    got = bf16.forward_logprobs(batch)
    assert got.dtype == torch.float32  # logprobs in fp32 from bf16 logits
    torch.testing.assert_close(got, reference, atol=BF16_ATOL, rtol=0)


def test_the_distributed_optimizer_takes_the_plain_step_at_dp1(cuda_world, tiny_qwen3, batch):
    """One GPU: megatron's DistributedOptimizer (DP=1: nothing to shard, but its DDP buffers, gradient
    finalisation, clipping and Adam) gives the same loss and weights as the trainer's own AdamW path."""
    plain, dist_opt = cuda_trainer(tiny_qwen3[0]), cuda_trainer(tiny_qwen3[0], distributed_optimizer=True)
    assert dist_opt.ddp is not None and plain.ddp is None
    m_plain, m_dist = plain.train_step(batch), dist_opt.train_step(batch)
    for key in ("loss", "grad_norm"):
        assert m_dist[key] == pytest.approx(m_plain[key], abs=1e-4), key
    want = exported(plain)
    for name, tensor in exported(dist_opt).items():
        torch.testing.assert_close(tensor, want[name], atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def fraction_changed(trainer, batch: dict, steps: int = 10) -> float:
    """The fraction of the weights the optimizer steps (bf16: the fp32 masters) that ``steps`` train
    steps change."""
    weights = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    before = [w.detach().clone() for w in weights]
    for _ in range(steps):
        trainer.train_step(batch)
    changed = sum(int((w.detach() != b).sum()) for w, b in zip(weights, before, strict=True))
    return changed / sum(b.numel() for b in before)


def test_a_bf16_step_changes_the_weights_and_stays_finite(cuda_world, tiny_qwen3, batch):
    """At an RL learning rate (1e-6, 10 steps) bf16 changes as many trained (fp32 master) weights as fp32
    does, with fp32 Adam moments; pure-bf16 AdamW changed ~2 % (the updates rounded away)."""
    trainer = cuda_trainer(tiny_qwen3[0], dtype="bfloat16", lr=1e-6)
    before = exported(trainer)
    metrics = trainer.train_step(batch)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    bf16 = fraction_changed(trainer, batch, steps=9)  # 10 steps in all
    after = exported(trainer)
    assert all(torch.isfinite(t.float()).all() for t in after.values())
    assert any(not torch.equal(after[n], t) for n, t in before.items())  # the steps moved them
    fp32 = fraction_changed(cuda_trainer(tiny_qwen3[0], lr=1e-6), batch)
    assert fp32 > 0.9 and bf16 == pytest.approx(fp32, abs=0.03)
    moments = {t.dtype for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"}
    assert moments == {torch.float32}


def test_export_stays_on_the_gpu(cuda_world, tiny_qwen3):
    """An NCCL sender broadcasts what the export yields: CUDA tensors, equal to the HF checkpoint."""
    trainer = cuda_trainer(tiny_qwen3[0])
    weights = {n: t for bucket in trainer.export_weights() for n, t in bucket}
    assert {t.device.type for t in weights.values()} == {"cuda"}
    for name, tensor in tiny_qwen3[2].items():
        assert torch.equal(weights[name].cpu(), tensor), name


@two_gpus
def test_pp2_with_the_distributed_optimizer_matches_plain_pp2(run_ranks, tiny_qwen3, batch):
    """PP=2 + ``distributed_optimizer`` builds (one ``calculate_per_token_loss``) and takes the step of
    the trainer's own PP=2 path."""
    model_dir = tiny_qwen3[0]
    plain = run_ranks("pp", model_dir, {"batch": batch}, script="gpu_worker.py")
    sharded = run_ranks("pp_distopt", model_dir, {"batch": batch}, script="gpu_worker.py")
    for key in ("loss", "grad_norm"):
        assert sharded["metrics"][key] == pytest.approx(plain["metrics"][key], abs=1e-4), key
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], tensor, atol=2e-4, rtol=0)


@two_gpus
def test_tp2_over_nccl_matches_hf(run_ranks, tiny_qwen3, batch):
    model_dir = tiny_qwen3[0]
    reference = torch_trainer(model_dir).forward_logprobs(batch)
    fp32 = run_ranks("tp", model_dir, {"batch": batch}, script="gpu_worker.py")
    torch.testing.assert_close(fp32["logprobs"], reference, atol=1e-4, rtol=0)
    assert math.isfinite(fp32["metrics"]["loss"]) and fp32["metrics"]["grad_norm"] > 0
    bf16 = run_ranks("tp", model_dir, {"batch": batch}, "--dtype", "bfloat16", script="gpu_worker.py")
    torch.testing.assert_close(bf16["logprobs"], reference, atol=BF16_ATOL, rtol=0)


@two_gpus
def test_distributed_optimizer_dp2_matches_plain_dp2(run_ranks, tiny_qwen3, batch):
    model_dir = tiny_qwen3[0]
    plain = run_ranks("dp", model_dir, {"batch": batch}, script="gpu_worker.py")
    sharded = run_ranks("dp_distopt", model_dir, {"batch": batch}, script="gpu_worker.py")
    for key in ("loss", "grad_norm"):
        assert sharded["metrics"][key] == pytest.approx(plain["metrics"][key], abs=1e-4), key
    assert sorted(sharded["weights"]) == sorted(plain["weights"])
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], tensor, atol=2e-4, rtol=0)


@pytest.mark.slow
def test_quickstart_megatron_runs_on_cuda(ray_session, tmp_path):
    """A short ``relax run`` of examples/quickstart_megatron.yaml with ``device: cuda`` (TP=2 with two GPUs,
    else TP=1): the rank actors reserve a GPU each, train and sync weights to the engine."""
    from relax.core.config import load_config
    from relax.core.controller.run import run

    tp = 2 if torch.cuda.device_count() >= 2 else 1
    run_dir = tmp_path / "megatron-cuda"
    cfg = load_config(
        EXAMPLE,
        [
            f"trainer.backend_params.tensor_parallel={tp}",
            "trainer.backend_params.device=cuda",
            "total_steps=3",
            f"run_dir={run_dir}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "trainer.micro_batch_size=8",
            "data.task_size=200",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    assert cfg.trainer.backend_params.device == "cuda"
    assert run(cfg)["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
