"""Qwen2 / Qwen3 language models (dense and MoE) as megatron-core builds them.

Qwen3: per-head q/k RMSNorms, no biases; Qwen2 LMs (those of Qwen2.5-VL / Qwen2.5-Omni): q/k/v biases and
no q/k norms. Qwen3-MoE: a softmax router over all experts, the top k renormalised when ``norm_topk_prob``,
every layer an MoE layer, no shared expert. The VL / Omni language models (relax-omni) add the 3-D rotary.
"""

from __future__ import annotations

from typing import Any

from relax.core.model_family import MegatronLayout, common_layout


def qwen_layout(hf_config: Any, qwen2: bool = False, **fields: Any) -> MegatronLayout:
    """The layout of a Qwen2 (``qwen2``) or Qwen3 language model, dense or MoE (``num_experts``)."""
    if getattr(hf_config, "attention_bias", False) and not qwen2:
        raise ValueError("Qwen3 with attention_bias=True is not supported by the megatron mapping yet")
    moe: dict[str, Any] = {}
    if getattr(hf_config, "num_experts", 0):
        if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
            raise ValueError(
                "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                "supported by the megatron mapping yet"
            )
        moe = dict(
            experts=hf_config.num_experts,
            topk=hf_config.num_experts_per_tok,
            moe_ffn=hf_config.moe_intermediate_size,
            norm_topk=bool(hf_config.norm_topk_prob),
        )
    return common_layout(hf_config, qkv_bias=qwen2, qk_norm=not qwen2, **moe, **fields)


MODEL_TYPES = ("qwen3", "qwen3_moe")
