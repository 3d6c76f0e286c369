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
    from relax.core.trainers.fsdp.params import model_parameters
    from relax.omni.tiny_models import tiny_multimodal_dir, wrap_whole_omni

    thinker_dir = tiny_multimodal_dir(tmp_path, family)
    whole_dir = wrap_whole_omni(thinker_dir, tmp_path / "whole", family)
    whole_config, thinker_config = (
        AutoConfig.from_pretrained(whole_dir),
        AutoConfig.from_pretrained(thinker_dir),
    )
    assert whole_config.model_type != thinker_config.model_type  # the checkpoint really is the whole model's
    assert model_config(whole_dir).model_type == thinker_config.model_type
    assert media_token_ids(model_config(whole_dir)) == media_token_ids(thinker_config) != []
    assert model_parameters(whole_dir) == model_parameters(thinker_dir)
    whole, thinker = load_model(whole_dir, "float32"), load_model(thinker_dir, "float32")
    assert type(whole) is type(thinker)
    got, want = whole.state_dict(), thinker.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want), (
        "a weight did not come from the checkpoint's thinker"
    )


@pytest.mark.parametrize("prefixed", [True, False], ids=["transformers-save", "thinker-layout"])
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_a_thinker_trained_from_a_whole_checkpoint_is_saved_back_whole(family, prefixed, tmp_path):
    """``save_hf`` writes the thinker the run trained; ``restore_layout`` (called by the trainer role and
    ``relax convert``) writes it back into the whole checkpoint: the trained weights under ``thinker.``, the
    source's other weights and files unchanged, its config. The saved names come under ``thinker.``
    (transformers' ``save_pretrained`` of the thinker it loaded out of the whole checkpoint: core's torch trainer)
    or as a thinker checkpoint's (the fsdp and megatron trainers write a thinker directory). The tiny checkpoint
    has no talker, so a ``talker.*`` tensor (and Qwen2.5-Omni's ``spk_dict.pt``) stand in for the released ones'."""
    import json

    from safetensors.torch import load_file, save_file

    from relax.core.multimodal_model import load_model, restore_layout
    from relax.omni.tiny_models import tiny_multimodal_dir, wrap_whole_omni

    whole_dir = wrap_whole_omni(tiny_multimodal_dir(tmp_path, family), tmp_path / "whole", family)
    talker = {
        "talker.model.embed_tokens.weight": torch.randn(5, 3),
        "talker.codec_head.weight": torch.randn(2, 3),
    }
    save_file(talker, f"{whole_dir}/talker.safetensors", metadata={"format": "pt"})
    (tmp_path / "whole" / "spk_dict.pt").write_bytes(b"speakers")
    source_names = {*load_file(f"{whole_dir}/model.safetensors"), *talker}

    model = load_model(whole_dir, "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # a training step's change
    saved = tmp_path / "final_hf"
    model.save_pretrained(saved)  # what the torch trainer's save_hf writes
    if not prefixed:
        file = saved / "model.safetensors"
        save_file(
            {k.removeprefix("thinker."): v for k, v in load_file(file).items()},
            file,
            metadata={"format": "pt"},
        )
    assert restore_layout(str(saved), whole_dir)

    config, source_config = (json.loads((d / "config.json").read_text()) for d in (saved, tmp_path / "whole"))
    assert config == source_config
    weights = {k: v for f in saved.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(weights) == source_names  # the checkpoint's own names: what SGLang and transformers load
    assert all(torch.equal(weights[n], t) for n, t in talker.items())
    assert (saved / "spk_dict.pt").read_bytes() == b"speakers"
    index = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == source_names and all((saved / f).is_file() for f in index.values())
    trained, reloaded = model.state_dict(), load_model(str(saved), "float32").state_dict()
    assert sorted(reloaded) == sorted(trained)
    assert all(torch.equal(reloaded[n], trained[n]) for n in trained), "a trained weight did not come back"
    assert not restore_layout(str(saved), whole_dir)  # already whole: nothing to do
    assert not restore_layout(
        str(saved), tiny_multimodal_dir(tmp_path, family)
    )  # a thinker run: its own layout
