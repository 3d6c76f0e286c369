"""TP=2 on CPU: two real processes over gloo. Vocab-parallel logprobs and entropy equal transformers'
(no full-logit gather: each rank holds half the vocabulary), and TP-gathered weights map back to the
HF checkpoint bit-exactly."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("tp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_logprobs_entropy_and_export_match_hf(tiny_qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    from relax.core.algorithms import entropy_from_logits

    model_dir, config, hf = tiny_qwen3
    tokens = torch.randint(0, config.vocab_size, (2, 25), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    port, out = _free_port(), tmp_path / "out.pt"
    cmd = [sys.executable, str(WORKER), "--world", "2", "--port", str(port), "--model-dir", model_dir,
           "--tokens", str(tmp_path / "tokens.pt"), "--out", str(out)]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "a TP rank failed:\n" + "\n---\n".join(log[-3000:] for log in logs)
    got = torch.load(out)
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
