"""A trainer's export in the served model's loader layout (``relax.sglang.served_layout``), checked against the
checkpoint transformers writes; the sync into a real Qwen3-Omni server is ``test_omni.py``'s."""

from __future__ import annotations

import json

import pytest
import torch


def test_the_thinker_export_maps_to_the_served_checkpoint_exactly(tmp_path):
    """The tiny Qwen3-Omni thinker as transformers holds it in memory (what every trainer exports: fused experts,
    ``model.language_model.*``), mapped bucket by bucket, is the served checkpoint: the same names, shapes and
    values, tower weights and every expert included."""
    from safetensors.torch import load_file
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from relax.sglang.served_layout import layout_for
    from relax.sglang.testing import tiny_omni_dirs

    server_dir, thinker_dir = tiny_omni_dirs(tmp_path)
    exported = list(
        Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(thinker_dir).state_dict().items()
    )
    assert any(
        n.endswith("mlp.experts.gate_up_proj") for n, _ in exported
    )  # the fused layout is what is mapped
    layout = layout_for("qwen3_omni_moe")  # declared by relax-omni's model adapter
    mapped = [item for i in range(0, len(exported), 7) for item in layout.map_bucket(exported[i : i + 7])]
    served = load_file(f"{server_dir}/model.safetensors")
    assert len(mapped) == len({n for n, _ in mapped}), "a name was sent twice"
    assert sorted(n for n, _ in mapped) == sorted(served)
    for name, tensor in mapped:
        assert torch.equal(tensor, served[name]), name
    assert (
        layout.map_bucket([("thinker.lm_head.weight", served["thinker.lm_head.weight"])])[0][0]
        == "thinker.lm_head.weight"
    )
    with pytest.raises(
        ValueError, match="'talker.codec_head.weight' is not one the served model's loader takes"
    ):
        layout.map_bucket(
            [("talker.codec_head.weight", torch.zeros(1))]
        )  # an error, not a name the server skips


def test_names_the_server_would_skip_are_refused_naming_the_mapping(tmp_path):
    from relax.sglang.served_layout import check_served_names, safetensors_names, served_architecture

    omni, vl = tmp_path / "omni", tmp_path / "vl"
    for d, kind in ((omni, "qwen3_omni_moe"), (vl, "qwen3_vl")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": kind}))
    wrapped = served_architecture(str(omni))
    assert wrapped == "qwen3_omni_moe"
    assert served_architecture(str(vl)) is None and served_architecture("Qwen/not-a-local-dir") is None
    with pytest.raises(
        ValueError, match="got 'model.layers.0.mlp.gate.weight'.*the sglang_\\* transports map"
    ):
        check_served_names(["thinker.lm_head.weight", "model.layers.0.mlp.gate.weight"], wrapped, "sglang[0]")
    check_served_names(["thinker.lm_head.weight"], wrapped, "sglang[0]")  # the checkpoint's own names load
    check_served_names(["model.layers.0.mlp.gate.weight"], None, "sglang[0]")  # any other model: as sent
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(2)}, str(vl / "model.safetensors"))
    assert list(safetensors_names(str(vl))) == ["model.norm.weight"]
