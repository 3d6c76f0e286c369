"""One in-process gloo world of size 1 with megatron's parallel state (TP=1, PP=1) per test module.

Module-scoped, not package-scoped: without an ``__init__.py`` pytest would keep a "package" fixture for the
whole session. Torn down (process group destroyed, CPU patches removed) after each module, so the rest of
a full pytest run sees an untouched torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # without it a megatron step is ~25x slower on CPU


def _world(tmp_path_factory, backend: str):
    """``torch.distributed`` (``backend``, world size 1; NCCL on cuda:0) + megatron parallel state, TP=1, PP=1."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax.megatron import cpu_compat
    from relax.megatron.parallel import initialize_model_parallel

    if backend == "nccl":
        torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp(backend) / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        initialize_model_parallel(tensor_parallel=1, pipeline_parallel=1, seed=1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.remove()  # on a GPU machine: at most the MoE router's (without Transformer Engine)


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """The CPU world: gloo."""
    yield from _world(tmp_path_factory, "gloo")


@pytest.fixture(scope="module")
def cuda_world(tmp_path_factory):
    """The GPU world (test_gpu.py): NCCL on cuda:0."""
    yield from _world(tmp_path_factory, "nccl")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(model_dir, HF config, HF state dict) of the conformance kit's tiny Qwen3 (built locally)."""
    from transformers import AutoConfig

    from relax.core.testing.models import load_hf_weights, tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("models"))
    return model_dir, AutoConfig.from_pretrained(model_dir), load_hf_weights(model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory, tiny_qwen3):
    """(model_dir, HF config, HF state dict) of a seeded tiny Qwen3-MoE (4 experts, top 2, renormalised
    as in the released Qwen3-MoE configs) with the tiny Qwen3's tokenizer, saved as transformers writes
    it (one tensor per expert)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax.core.testing.models import load_hf_weights

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    config = Qwen3MoeConfig(pad_token_id=tokenizer.pad_token_id,
        vocab_size=24, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, initializer_range=0.3, tie_word_embeddings=True,
    )  # fmt: skip
    model_dir = tmp_path_factory.mktemp("moe") / "qwen3-moe"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir), AutoConfig.from_pretrained(model_dir), load_hf_weights(str(model_dir))


@pytest.fixture(scope="session")
def fuse_experts():
    """``fuse(weights, config)``: an export's per-expert HF names (as checkpoints and SGLang name them) as
    transformers' in-memory fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (what core's torch trainer
    exports for Qwen3-MoE); a new dict."""
    import torch

    def fuse(weights: dict, config) -> dict:
        out = dict(weights)
        for i in range(config.num_hidden_layers):
            e = f"model.layers.{i}.mlp.experts."
            experts = range(config.num_experts)
            out[e + "gate_up_proj"] = torch.stack([torch.cat([out.pop(f"{e}{j}.gate_proj.weight"),
                                                              out.pop(f"{e}{j}.up_proj.weight")]) for j in experts])  # fmt: skip
            out[e + "down_proj"] = torch.stack([out.pop(f"{e}{j}.down_proj.weight") for j in experts])
        return out

    return fuse


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory):
    """``run(mode, model_dir, data, *extra, world=2, expect_ok=True, script="tp_worker.py")``: ``script``
    as ``world`` processes on ``data``; rank 0's results, or with ``expect_ok=False`` the ranks' combined
    output."""

    def run(mode: str, model_dir: str, data, *extra: str, world: int = 2, expect_ok: bool = True,
            script: str = "tp_worker.py"):  # fmt: skip
        import torch

        tmp_path = tmp_path_factory.mktemp(mode)
        torch.save(data, tmp_path / f"{mode}-input.pt")
        out = tmp_path / f"{mode}-out.pt"
        cmd = [sys.executable, str(Path(__file__).with_name(script)), "--mode", mode, "--world", str(world),
               "--port", str(_free_port()), "--model-dir", model_dir, "--input", str(tmp_path / f"{mode}-input.pt"),
               "--out", str(out), *extra]  # fmt: skip
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(world)]  # fmt: skip
        try:
            logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                p.kill()
        ok = all(p.returncode == 0 for p in procs)
        if not expect_ok:
            assert not ok, f"{mode} with {extra} succeeded, expected a failure"
            return "\n".join(logs)
        assert ok, "a rank failed:\n" + "\n---\n".join(log[-3000:] for log in logs)
        return torch.load(out)

    return run
