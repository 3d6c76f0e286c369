"""MoE routing replay on SGLang without a server: the request flag and the decoding of ``meta_info.routed_experts``
(SGLang's base64 int32 ``(tokens - 1, hidden layers, top_k)``) into Relax's per-sample array."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.payload import generate_payload
from relax.sglang.routing import RoutingLayout


def _config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=16,
        moe_intermediate_size=8,
        vocab_size=32,
    )
    return Qwen3MoeConfig(**{**base, **kw})


def test_the_request_asks_for_routed_experts_only_when_recording():
    req = GenerationRequest("r", [1, 2], SamplingParams(max_new_tokens=4))
    assert generate_payload(req, "rid", [], routed_experts=True)["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_payload(req, "rid", [])


def test_routed_experts_decode_to_moe_layers_compactly_with_the_last_token_unrecorded():
    layout = RoutingLayout.from_config(_config(mlp_only_layers=[1]))  # layer 1 is dense
    assert layout.moe_layers == (0, 2, 3) and layout.top_k == 2
    tokens = 6  # SGLang routes the 5 tokens a forward fed
    sent = np.arange(5 * 4 * 2, dtype=np.int32).reshape(5, 4, 2) % 8
    meta = {"routed_experts": base64.b64encode(sent.tobytes()).decode()}
    got = layout.decode(meta, tokens)
    assert got.shape == (6, 3, 2) and got.dtype == np.int8
    assert (got[:5] == sent[:, [0, 2, 3]]).all() and (got[5] == -1).all()
    assert (layout.decode(meta, 3) == sent[:3, [0, 2, 3]]).all()  # a response cut at a stop id
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        layout.decode({"id": "x"}, tokens)


def test_a_family_declaring_its_routing_keeps_its_moe_layers_only():
    """GLM-4-MoE (relax-models' adapter declares ``moe_routing``): its dense first layer has no column."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "glm4_moe", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2
    )
    layout = RoutingLayout.from_config(config)
    assert (layout.num_layers, layout.moe_layers, layout.top_k, layout.num_experts) == (3, (1, 2), 2, 4)
    sent = np.arange(3 * 3 * 2, dtype=np.int32).reshape(3, 3, 2) % 4
    got = layout.decode({"routed_experts": base64.b64encode(sent.tobytes()).decode()}, 4)
    assert got.shape == (4, 2, 2) and (got[:3] == sent[:, 1:]).all() and (got[3] == -1).all()


def test_a_dense_model_is_refused_naming_the_setting():
    from transformers import Qwen3Config

    with pytest.raises(ValueError, match="algorithm.routing_replay: off"):
        RoutingLayout.from_config(Qwen3Config(num_hidden_layers=2))
