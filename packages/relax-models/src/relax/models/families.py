"""The text-LM families' adapters and the model types each is registered for.

GLM-4.5-style MoE (``glm4_moe``): grouped-query attention with partial rotary (``partial_rotary_factor``, the
first dims of each head rotated, half-rotation style), optional q/k/v biases and q/k norms, the first
``first_k_dense_replace`` layers dense, then MoE layers with shared experts and a sigmoid router whose
per-expert bias (``e_score_correction_bias``) picks the experts but not their weights, scaled by
``routed_scaling_factor``. DeepSeek-V3 (``deepseek_v3``): the same MoE under multi-latent attention (queries
and keys/values through low-rank projections, a decoupled rotary part). GLM-5 (``glm_moe_dsa``): MLA with a
sparse-attention indexer (``attention: sparse``), which relax-megatron refuses by name: it runs on the torch /
fsdp trainers (core's HF path needs no adapter for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from relax.core.model_family import MegatronLayout, MoeRouting, common_layout
from relax.models import qwen


def _rotary_fraction(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))


def _sigmoid_moe(hf_config: Any) -> dict[str, Any]:
    """The MoE fields shared by GLM-4-MoE and DeepSeek-V3."""
    return dict(
        experts=hf_config.n_routed_experts,
        topk=hf_config.num_experts_per_tok,
        moe_ffn=hf_config.moe_intermediate_size,
        norm_topk=bool(hf_config.norm_topk_prob),
        router="sigmoid",
        expert_bias=True,
        topk_scaling=float(hf_config.routed_scaling_factor),
        shared_ffn=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
        dense_layers=int(hf_config.first_k_dense_replace),
        router_groups=int(hf_config.n_group or 0),
        router_topk_groups=int(hf_config.topk_group or 0),
    )


def sigmoid_routing(hf_config: Any) -> MoeRouting:
    """What routes outside megatron (a serving engine's recorded columns, the torch trainers' replay): the layers
    after the dense first ones; each expert weighted by its own sigmoid score, renormalised and scaled."""
    return MoeRouting(
        moe_layers=tuple(range(int(hf_config.first_k_dense_replace), hf_config.num_hidden_layers)),
        experts=hf_config.n_routed_experts,
        topk=hf_config.num_experts_per_tok,
        score="sigmoid",
        norm_topk=bool(hf_config.norm_topk_prob),
        scaling=float(hf_config.routed_scaling_factor),
    )


def glm4_moe_layout(hf_config: Any) -> MegatronLayout:
    return common_layout(
        hf_config,
        qkv_bias=bool(hf_config.attention_bias),
        qk_norm=bool(hf_config.use_qk_norm),
        rotary_percent=_rotary_fraction(hf_config),
        **_sigmoid_moe(hf_config),
    )


def mla_layout(hf_config: Any, attention: str = "mla") -> MegatronLayout:
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(
            f"{hf_config.model_type} with attention_bias=True is not supported by the megatron mapping yet"
        )
    heads = hf_config.num_attention_heads
    return common_layout(
        hf_config,
        attention=attention,
        groups=heads,
        head_dim=hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim,
        qk_norm=False,
        q_lora_rank=int(hf_config.q_lora_rank or 0),
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_dim=hf_config.qk_nope_head_dim,
        qk_rope_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        **_sigmoid_moe(hf_config),
    )


@dataclass(frozen=True)
class TextFamily:
    """A text-only family: core's HF path loads it as a plain causal LM; relax-megatron builds ``layout``;
    ``routing`` (None: a Qwen-style softmax router, or none) says how its MoE routers route."""

    takes_media: ClassVar[bool] = False
    layout: Callable[[Any], MegatronLayout]
    routing: Callable[[Any], MoeRouting] | None = None

    def megatron_layout(self, hf_config: Any) -> MegatronLayout:
        return self.layout(hf_config)

    def moe_routing(self, hf_config: Any) -> MoeRouting | None:
        return None if self.routing is None else self.routing(hf_config)


#: HF ``config.model_type`` -> the layout of its megatron model
LAYOUTS: dict[str, Callable[[Any], MegatronLayout]] = {
    **{model_type: qwen.qwen_layout for model_type in qwen.MODEL_TYPES},
    "glm4_moe": glm4_moe_layout,
    "deepseek_v3": mla_layout,
    "glm_moe_dsa": lambda config: mla_layout(config, attention="sparse"),
}
#: HF ``config.model_type`` -> its declared MoE routing (``TextFamily.routing``)
ROUTINGS: dict[str, Callable[[Any], MoeRouting]] = {
    model_type: sigmoid_routing for model_type in ("glm4_moe", "deepseek_v3", "glm_moe_dsa")
}


def _factory(
    layout: Callable[[Any], MegatronLayout], routing: Callable[[Any], MoeRouting] | None
) -> Callable[[], TextFamily]:
    def make() -> TextFamily:
        return TextFamily(layout, routing)

    make.__qualname__ = f"TextFamily[{getattr(layout, '__name__', 'layout')}]"
    return make


def register_adapters(register: Callable[..., None]) -> None:
    factories: dict[tuple[int, int], Callable[[], TextFamily]] = {}
    for model_type, layout in LAYOUTS.items():
        routing = ROUTINGS.get(model_type)
        key = (id(layout), id(routing))
        register(model_type, factories.setdefault(key, _factory(layout, routing)))
