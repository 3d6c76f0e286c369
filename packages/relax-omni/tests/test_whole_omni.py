"""A whole Qwen-Omni checkpoint, as released (thinker, talker and vocoder under one config; here without the
talker), trains and rolls out as its thinker: the adapter loads the thinker's weights out of it and reports the
thinker's config, so every backend and engine that reads ``relax.core.multimodal_model`` runs it unchanged."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_a_whole_omni_checkpoint_loads_as_its_thinker(family, tmp_path):
    from transformers import AutoConfig

    from relax.core.multimodal_model import load_model, media_token_ids, model_config
    from relax.core.testing.multimodal_models import tiny_multimodal_dir, wrap_whole_omni
    from relax.core.trainers.fsdp.params import model_parameters

    thinker_dir = tiny_multimodal_dir(tmp_path, family)
    whole_dir = wrap_whole_omni(thinker_dir, tmp_path / "whole", family)
    whole_config, thinker_config = AutoConfig.from_pretrained(whole_dir), AutoConfig.from_pretrained(thinker_dir)
    assert whole_config.model_type != thinker_config.model_type  # the checkpoint really is the whole model's
    assert model_config(whole_dir).model_type == thinker_config.model_type
    assert media_token_ids(model_config(whole_dir)) == media_token_ids(thinker_config) != []
    assert model_parameters(whole_dir) == model_parameters(thinker_dir)
    whole, thinker = load_model(whole_dir, "float32"), load_model(thinker_dir, "float32")
    assert type(whole) is type(thinker)
    got, want = whole.state_dict(), thinker.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want), "a weight did not come from the checkpoint's thinker"
