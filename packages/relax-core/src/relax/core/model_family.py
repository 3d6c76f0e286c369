"""What a model family declares for the backends beyond core's HF path: the megatron layout of its language
model, the hooks of its media towers on megatron, its conventions with a serving engine and how its MoE
routers route.

A family lives in one ``ModelAdapter`` (``relax.core.protocols``), registered per ``config.model_type``
through ``relax_register_model_adapters``. Core's HF trainer and engine use an adapter only when it takes
media (``ModelAdapter.takes_media``, default True); a text-only family (``takes_media = False``) registers
one all the same so that relax-megatron can build and fill megatron-core's model for it and relax-sglang can
serve it, and neither backend names a family (``test_model_families``). The values here are plain data:
core imports no backend, and a backend reads them through :func:`family_adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``MegatronLayout.attention``: grouped-query attention, multi-latent attention, MLA + a sparse-attention indexer
ATTENTION_KINDS = ("gqa", "mla", "sparse")
#: ``MegatronLayout.rotary``: 1-D rotary (``rotary_percent`` < 1: partial), 3-D (T, H, W) rotary with chunked
#: or interleaved frequencies
ROTARY_KINDS = ("rope", "multi_axis", "multi_axis_interleaved")
#: ``MegatronLayout.router``: the MoE router's score function
ROUTER_KINDS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MegatronLayout:
    """One HF language model as megatron-core builds it (``ModelAdapter.megatron_layout``): shapes, layer-spec
    choices and which weights the HF <-> megatron mapping fuses. HF weight names are transformers' common
    decoder names (``model.layers.<i>.self_attn.q_proj`` ...); a field says which of them a layer has."""

    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (GQA); MLA: = heads
    head_dim: int
    ffn: int  # the dense MLP's intermediate size (every layer of a dense model, the first ``dense_layers`` of MoE)
    vocab: int
    tied: bool
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 4096
    init_std: float = 0.02
    attention: str = "gqa"
    qkv_bias: bool = False  # q/k/v projections with biases (fused into ``linear_qkv.bias``)
    qk_norm: bool = True  # per-head q/k RMSNorms
    rotary: str = "rope"
    rotary_percent: float = 1.0  # partial rotary: the fraction of each head's dims rotated
    rotary_sections: tuple[int, ...] = ()  # 3-D rotary: the (T, H, W) frequency split
    # MoE (``experts`` 0: dense)
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    norm_topk: bool = False  # renormalise the top-k scores
    router: str = "softmax"
    expert_bias: bool = False  # a sigmoid router's per-expert selection bias (HF ``e_score_correction_bias``)
    topk_scaling: float = 1.0  # routed experts' output scale (HF ``routed_scaling_factor``)
    shared_ffn: int = 0  # shared experts' intermediate size (HF ``mlp.shared_experts``; 0: none)
    dense_layers: int = 0  # the first layers keep a dense MLP (HF ``first_k_dense_replace``)
    router_groups: int = 0  # group-limited routing: expert groups, of which ``router_topk_groups`` are kept
    router_topk_groups: int = 0
    # MLA (``attention`` mla / sparse)
    q_lora_rank: int = (
        0  # 0: queries projected directly (HF ``q_proj``), else through ``q_a_proj`` / ``q_b_proj``
    )
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for field, value, kinds in (
            ("attention", self.attention, ATTENTION_KINDS),
            ("rotary", self.rotary, ROTARY_KINDS),
            ("router", self.router, ROUTER_KINDS),
        ):
            if value not in kinds:
                raise ValueError(f"MegatronLayout.{field}={value!r}: expected one of {list(kinds)}")

    @property
    def rotary_interleaved(self) -> bool:
        """3-D rotary with the (T, H, W) frequencies interleaved, not chunked."""
        return self.rotary == "multi_axis_interleaved"


@dataclass(frozen=True)
class MediaTowerHooks:
    """Where the media front (HF's towers, placeholder scatter and rope index feeding megatron's language
    model) finds its parts in the HF model the adapter loads (``ModelAdapter.megatron_media``)."""

    lm_prefix: str  # in-memory HF names of the language model's weights (e.g. ``model.language_model.``)
    language_model: str = "language_model"  # attribute of ``model.model`` the front replaces by a stub
    towers: tuple[str, ...] = ()  # attributes of ``model.model`` a later pipeline stage drops
    position_rows: int = 3  # rows of the positions the front passes megatron (extra leading rows are dropped)
    deepstack_layers: int = 0  # first decoder layers after which visual embeddings are added (DeepStack)
    dense_optimizer_only: bool = True  # megatron's distributed optimizer does not hold the HF towers


@dataclass(frozen=True)
class ServingConventions:
    """What a serving engine and the family's processor agree on (``ModelAdapter.serving``): declared here,
    not in comments on both sides."""

    media_config_key: str = ""  # the sub-config of ``config.json`` the media model reads ("": the top level)
    audio_sample_rate: int = (
        0  # Hz of the decoded waveforms the processor keeps (``source.audio.*``); 0: no audio
    )
    #: how videos reach the server: "" none, "fps" one video per prompt with the sampling fps as metadata,
    #: "timestamped" the prompt carries each temporal grid's time
    video_layout: str = ""
    served_prefix: str = ""  # the served checkpoint's names are under this prefix (a model served whole)
    served_renames: tuple[tuple[str, str], ...] = ()  # exported name prefix -> served name prefix (under it)


@dataclass(frozen=True)
class MoeRouting:
    """How a family's MoE routers pick and weight experts (``ModelAdapter.moe_routing``), for the parts that read
    routing from an HF model rather than megatron's layout: a serving engine's recorded routing keeps the
    ``moe_layers`` columns (dense first layers have none), and the torch trainers' replay weights the recorded
    experts as the router would (``relax.core.routing_replay``)."""

    moe_layers: tuple[int, ...]  # decoder layers with routed experts, in order
    experts: int
    topk: int
    score: str = "softmax"  # ``ROUTER_KINDS``; sigmoid: the experts' weights are their own sigmoid scores
    norm_topk: bool = False  # renormalise the chosen experts' weights
    scaling: float = 1.0  # the routed experts' output scale (HF ``routed_scaling_factor``)

    def __post_init__(self) -> None:
        if self.score not in ROUTER_KINDS:
            raise ValueError(f"MoeRouting.score={self.score!r}: expected one of {list(ROUTER_KINDS)}")


def moe_routing(hf_config: Any) -> MoeRouting | None:
    """The routing the family's adapter declares for an HF config (None: none declared, a Qwen-style router)."""
    declared = getattr(family_adapter(getattr(hf_config, "model_type", None)), "moe_routing", None)
    return None if declared is None else declared(hf_config)


def family_adapter(model_type: str | None) -> Any:
    """The adapter registered for ``model_type`` whether or not it takes media (None: none registered)."""
    from relax.core.multimodal_model import registered_adapter

    return registered_adapter(model_type)


def megatron_layout(hf_config: Any) -> MegatronLayout:
    """The megatron layout of an HF language-model config, from its family's adapter; an error naming the
    model type and the hook when no adapter declares one."""
    model_type = getattr(hf_config, "model_type", None)
    adapter = family_adapter(model_type)
    layout = getattr(adapter, "megatron_layout", None)
    if layout is None:
        raise ValueError(
            f"model_type {model_type!r}: no installed plugin's model adapter declares a megatron layout "
            "for it (ModelAdapter.megatron_layout, registered through relax_register_model_adapters; "
            "docs/model-families.md); use trainer.backend: torch or fsdp for this model"
        )
    return layout(hf_config)


def serving_conventions(model_type: str | None) -> ServingConventions:
    """The family's serving conventions (empty ones for a model type without an adapter or declaration)."""
    serving = getattr(family_adapter(model_type), "serving", None)
    return ServingConventions() if serving is None else serving(model_type)


def common_layout(hf_config: Any, **fields: Any) -> MegatronLayout:
    """A :class:`MegatronLayout` from the config fields every HF decoder-only config names alike, with
    ``fields`` (the family's choices) on top."""
    heads = hf_config.num_attention_heads
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={params['rope_type']!r} is not supported by the megatron mapping yet")
    if theta is None:
        raise ValueError("the HF config names no rope_theta")
    base = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        tied=bool(hf_config.tie_word_embeddings),
        norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(theta),
        max_positions=int(hf_config.max_position_embeddings),
        init_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )
    return MegatronLayout(**{**base, **fields})
