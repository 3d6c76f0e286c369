"""Tiny seeded GLM-4-MoE and DeepSeek-V3 models built locally from a config (nothing downloaded): what the
megatron family tests and the quick-start runs of these families train.

Three layers, the first dense, then MoE layers of 4 routed experts (top 2) with one shared expert and a
sigmoid router whose selection biases are random (so they change which experts are picked); GLM-4-MoE with
partial rotary and q/k/v biases, DeepSeek-V3 with multi-latent attention.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: the MoE shape both families share
MOE: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    initializer_range=0.3,
    max_position_embeddings=128,
)
#: model type -> its attention and routing scale
CONFIGS: dict[str, dict[str, Any]] = {
    "glm4_moe": dict(
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=True,
        routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        routed_scaling_factor=2.5,
    ),
}


def tiny_family_dir(
    directory: str | os.PathLike[str], model_type: str, tokenizer: Any, seed: int = 0, **overrides: Any
) -> str:
    """Save a seeded tiny ``model_type`` model (``MOE`` + ``CONFIGS[model_type]`` + ``overrides``) with
    ``tokenizer`` to ``directory`` unless it is there already; returns the path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = Path(directory)
    if (target / "config.json").exists():
        return str(target)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **{**MOE, **CONFIGS[model_type], **overrides},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.2)
        model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)
