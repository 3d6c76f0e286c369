"""A tiny Qwen3-MoE (2 layers, 4 experts, top 2) with the quick-start tokenizer, built locally from a config:
what the MoE routing-replay tests run on (``relax.core.routing_replay``)."""

from __future__ import annotations

import os
from pathlib import Path


def tiny_moe_dir(directory: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a seeded tiny Qwen3-MoE (``norm_topk_prob``, large init so routing is far from uniform) to
    ``directory`` unless it is there already; returns the path."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax.core.quickstart_model import build_tokenizer

    target = Path(directory)
    if (target / "config.json").exists():
        return str(target)
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen3MoeForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)
