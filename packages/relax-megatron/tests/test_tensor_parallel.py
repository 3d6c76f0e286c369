"""TP=2 on CPU: two real processes over gloo. Vocab-parallel logprobs and entropy equal transformers'
(no full-logit gather: each rank holds half the vocabulary), TP-gathered weights map back to the HF
checkpoint bit-exactly, and a TP=2 train step matches core's torch trainer."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, model_dir: str, data, tmp_path: Path, world: int = 2) -> dict:
    """Run ``tp_worker.py`` as ``world`` processes on ``data``; rank 0's results."""
    torch.save(data, tmp_path / f"{mode}-input.pt")
    out = tmp_path / f"{mode}-out.pt"
    cmd = [sys.executable, str(WORKER), "--mode", mode, "--world", str(world), "--port", str(_free_port()),
           "--model-dir", model_dir, "--input", str(tmp_path / f"{mode}-input.pt"), "--out", str(out)]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    try:
        logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "a TP rank failed:\n" + "\n---\n".join(log[-3000:] for log in logs)
    return torch.load(out)


def test_tp2_logprobs_entropy_and_export_match_hf(tiny_qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    from relax.core.algorithms import entropy_from_logits

    model_dir, config, hf = tiny_qwen3
    tokens = torch.randint(0, config.vocab_size, (2, 25), generator=torch.Generator().manual_seed(5))
    got = run_ranks("convert", model_dir, tokens, tmp_path)
    assert got["logits_shape"][-1] == config.vocab_size // 2  # each rank scored half the vocabulary
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(inputs).logits
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got["logprobs"], ref, rtol=1.3e-6, atol=1e-5)  # same tolerance as TP=1
    torch.testing.assert_close(got["entropy"], entropy_from_logits(ref_logits), rtol=1.3e-6, atol=1e-5)
    assert sorted(got["hf"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got["hf"][name], tensor), name


def test_tp2_train_step_matches_the_torch_trainer(tiny_qwen3, tmp_path):
    """Same weights, batch and objective as core's torch trainer at TP=1: the same logprobs, loss, grad
    norm (TP shards and replicated norms each counted once) and gathered updated weights."""
    from transformers import AutoTokenizer

    from relax.core.testing import make_batch, make_samples, torch_trainer
    from relax.core.testing.trainer import exported

    model_dir, _, _ = tiny_qwen3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    ref = torch_trainer(model_dir, lr=1e-2, eps=1e-4, micro_batch_size=4)  # eps: see test_trainer.py
    batch["old_logprobs"] = ref.forward_logprobs(batch)
    got = run_ranks("train", model_dir, batch, tmp_path)
    torch.testing.assert_close(got["logprobs"], batch["old_logprobs"], atol=1e-5, rtol=0)
    metrics = ref.train_step(batch)
    for key in ("loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    want = exported(ref)
    assert sorted(got["weights"]) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
