"""relax-omni's model adapters: core's trainer and HF engine load and feed the Qwen VL / Omni thinkers only
through them (``relax_register_model_adapters``); without the plugin core refuses those checkpoints by name."""

from __future__ import annotations

import pytest
import torch

from relax.core import plugins
from relax.core.model_family import family_adapter
from relax.core.multimodal_model import (
    UnsupportedModelError,
    adapter_for,
    freeze_towers,
    is_multimodal_model,
    is_tower,
    load_model,
    media_forward_kwargs,
    media_token_ids,
)
from relax.core.quickstart_model import ensure_quickstart_model
from relax.omni.adapters import AUDIO_IN_VIDEO, LM_TYPES, MODEL_TYPES, QwenMediaAdapter, QwenMediaLMAdapter
from relax.omni.tiny_models import FAMILIES, tiny_multimodal_dir

MODEL_TYPE = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen2_5_omni": "qwen2_5_omni_thinker",
    "qwen3_omni": "qwen3_omni_moe_thinker",
}


def test_the_plugin_registers_every_family_it_processes():
    manager = plugins.get_plugin_manager()
    assert set(MODEL_TYPES) <= set(manager.names("model_adapter")) and set(MODEL_TYPE.values()) <= set(
        MODEL_TYPES
    )
    assert {manager.registration("model_adapter", t).plugin for t in MODEL_TYPES} == {"omni"}
    assert "model_adapter: " + ", ".join(sorted((*MODEL_TYPES, *LM_TYPES))) in plugins.format_plugins(manager)
    assert isinstance(adapter_for("qwen3_vl"), QwenMediaAdapter) and adapter_for("qwen3") is None
    # the VL / Omni language models: declared for the backends, invisible to core's HF path (no media)
    assert adapter_for("qwen3_vl_text") is None and isinstance(
        family_adapter("qwen3_vl_text"), QwenMediaLMAdapter
    )
    from relax.core.multimodal_model import media_flag_keys

    assert AUDIO_IN_VIDEO in media_flag_keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_core_loads_and_freezes_through_the_adapter(family, tmp_path_factory):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    model = load_model(model_dir, "float32")
    assert model.config.model_type == MODEL_TYPE[family] and is_multimodal_model(model_dir)
    assert type(model).__name__.endswith("ForConditionalGeneration")
    config = model.config
    ids = media_token_ids(config)
    image = getattr(config, "image_token_id", None)
    assert (image if image is not None else config.image_token_index) in ids
    assert len(ids) == len(set(ids)) >= 3
    names = [n for n, _ in model.named_parameters()]
    towers = [n for n in names if is_tower(n, model)]
    assert towers and all(".visual." in f".{n}" or "audio_tower." in n for n in towers)
    assert [n for n in names if is_tower(n)] == towers  # without a model: every registered adapter's prefixes
    assert freeze_towers(model)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(towers)


def test_without_the_plugin_core_refuses_media_models_by_name(tmp_path_factory, monkeypatch):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    text_dir = ensure_quickstart_model()
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "omni")
    try:
        plugins.get_plugin_manager(refresh=True)
        assert adapter_for("qwen2_5_vl") is None
        with pytest.raises(UnsupportedModelError, match=r"model_type 'qwen2_5_vl'.*relax-omni registers"):
            load_model(model_dir, "float32")
        text = load_model(text_dir, "float32")  # the generic path needs no adapter
        assert not freeze_towers(text) and media_token_ids(text.config) == []
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(
            UnsupportedModelError, match=r"model_type 'qwen3': a request or row carries media"
        ):
            media_forward_kwargs(text, ids, torch.ones_like(ids), {"pixel_values": torch.zeros(1, 4)}, 3)
    finally:
        monkeypatch.delenv("RELAX_DISABLE_PLUGINS")
        plugins.get_plugin_manager(refresh=True)
    assert adapter_for("qwen2_5_vl") is not None
