"""relax-models registers the text-LM families' adapters: declared for the backends (a megatron layout), unseen by
core's HF path (``takes_media`` False: loaded as plain causal LMs)."""

from __future__ import annotations

import pytest

from relax.core import plugins
from relax.core.model_family import MegatronLayout, family_adapter, megatron_layout
from relax.core.multimodal_model import adapter_for, is_multimodal_model, load_model
from relax.models.families import LAYOUTS, TextFamily

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def test_the_plugin_registers_every_family_text_only():
    manager = plugins.get_plugin_manager()
    assert {manager.registration("model_adapter", t).plugin for t in LAYOUTS} == {"models"}
    for model_type in LAYOUTS:
        adapter = family_adapter(model_type)
        assert isinstance(adapter, TextFamily) and adapter.takes_media is False
        assert adapter_for(model_type) is None  # core's media dispatch ignores it


def test_core_loads_a_registered_text_family_as_a_plain_causal_lm(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "glm4_moe", **TINY, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2
    )
    config.save_pretrained(tmp_path)
    assert not is_multimodal_model(str(tmp_path))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert type(load_model(str(tmp_path), "float32")).__name__ == "Glm4MoeForCausalLM"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_qwen_layouts(model_type):
    from transformers import AutoConfig

    extra = (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
        if model_type == "qwen3_moe"
        else {}
    )
    layout = megatron_layout(
        AutoConfig.for_model(model_type, **TINY, num_key_value_heads=2, head_dim=8, **extra)
    )
    assert isinstance(layout, MegatronLayout) and (layout.qk_norm, layout.qkv_bias, layout.router) == (
        True,
        False,
        "softmax",
    )
    assert layout.experts == (4 if extra else 0) and layout.groups == 2 and layout.head_dim == 8


def test_a_bad_layout_names_the_field():
    with pytest.raises(ValueError, match="MegatronLayout.router='topk': expected one of"):
        MegatronLayout(1, 8, 2, 2, 4, 16, 32, False, router="topk")


def test_the_sigmoid_router_families_declare_their_routing():
    """GLM-4-MoE / DeepSeek-V3 declare which layers route and how (``moe_routing``); Qwen-style routers do not."""
    from transformers import AutoConfig

    from relax.core.model_family import moe_routing

    moe = dict(TINY, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2)
    for model_type in ("glm4_moe", "deepseek_v3"):
        routing = moe_routing(AutoConfig.for_model(model_type, **moe, routed_scaling_factor=2.0))
        assert (routing.moe_layers, routing.experts, routing.topk) == ((1, 2), 4, 2)
        assert (routing.score, routing.norm_topk, routing.scaling) == ("sigmoid", True, 2.0)
    qwen = AutoConfig.for_model("qwen3_moe", **TINY, num_experts=4, num_experts_per_tok=2)
    assert moe_routing(qwen) is None
