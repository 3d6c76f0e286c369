"""The tiny model every conformance suite runs on, built locally (no hub), once per pytest session.

A seeded two-layer Qwen3 with the quick-start's character-level tokenizer (24 tokens, chat template,
``<|im_end|>`` as EOS). The larger init scale (0.3) makes its next-token distributions far from
uniform, so logprob comparisons are not vacuous and EOS is sampled often enough to test stop rules.
Every tensor carries seeded noise, so the models of two seeds differ in every tensor.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

#: the model the suites run on (``seed``) and the one ``update_weights`` tests switch to
MODEL_SEED, OTHER_MODEL_SEED = 1, 2
MODEL_OVERRIDES: dict[str, Any] = {"initializer_range": 0.3}

_build_lock = threading.Lock()

#: the shape of Qwen3-0.6B (config only: benchmarks on a device build it randomly initialised, nothing downloaded)
QWEN3_06B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}


def build_qwen3_06b(
    directory: str | os.PathLike[str], tokenizer_dir: str, device: str = "cpu"
) -> tuple[str, int]:
    """A randomly initialised Qwen3-0.6B-shaped model saved (bf16) to ``directory`` with the tiny model's
    tokenizer (ids past its vocabulary decode to nothing): (path, parameter count, a tied embedding once)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return str(directory), params


def tiny_model_dir(root: str | os.PathLike[str], seed: int = MODEL_SEED) -> str:
    """Path of the tiny model for ``seed`` under ``root``, built on first use (safetensors + tokenizer)."""
    from relax.core.quickstart_model import build_tiny_model

    target = Path(root) / f"relax-conformance-tiny-seed{seed}"
    with _build_lock:
        if not (target / "config.json").exists():
            build_tiny_model(target, seed=seed, **MODEL_OVERRIDES)
            _perturb(target, seed)
    return str(target)


def _perturb(model_dir: Path, seed: int) -> None:
    """Add seeded noise to every tensor, so two seeds differ everywhere (freshly initialised norms
    are all ones: a weight sync that dropped them would otherwise go unnoticed)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        noisy = {n: t + 0.02 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in tensors.items()}
        save_file(noisy, shard, metadata={"format": "pt"})


def load_hf_weights(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's tensors by HF name, as written by ``save_pretrained`` (tied weights once)."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(shard))
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return out


def eos_token_ids(model_dir: str | os.PathLike[str]) -> frozenset[int]:
    """EOS ids an engine must stop at: the generation config's plus the tokenizer's."""
    from transformers import AutoTokenizer

    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return frozenset(ids)


def run_async(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run one coroutine to completion on a fresh event loop, failing after ``timeout_s``."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


class TinyModelFixtures:
    """``model_dir`` / ``other_model_dir`` / ``tokenizer`` fixtures shared by the suites.

    Override ``model_dir`` (a class-scoped fixture returning a path) to run a suite on another
    model; the suites only assume a causal LM with a chat-template tokenizer and an EOS token.
    """

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        return tiny_model_dir(tmp_path_factory.getbasetemp(), MODEL_SEED)

    @pytest.fixture(scope="class")
    @classmethod
    def other_model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        """Same architecture and tokenizer, different weights (seed 2)."""
        return tiny_model_dir(tmp_path_factory.getbasetemp(), OTHER_MODEL_SEED)

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls, model_dir: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
