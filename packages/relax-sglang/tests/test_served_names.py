"""Trained weight names against the served model's loader (``relax.sglang.served_names``); the refusal on a real
Qwen3-Omni server is ``test_omni.py``'s (opt-in: its own launch)."""

from __future__ import annotations

import json

import pytest

from relax.sglang.served_names import check_served_names, served_architecture


def test_a_thinker_export_into_qwen3_omni_served_whole_is_refused_naming_what_to_use(tmp_path):
    omni, vl = tmp_path / "omni", tmp_path / "vl"
    for d, arch in ((omni, "Qwen3OmniMoeForConditionalGeneration"), (vl, "Qwen3VLForConditionalGeneration")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    wrapped = served_architecture(str(omni))
    assert wrapped == "Qwen3OmniMoeForConditionalGeneration"
    assert served_architecture(str(vl)) is None and served_architecture("Qwen/not-a-local-dir") is None
    with pytest.raises(ValueError, match="'model.layers.0.mlp.gate.weight'.*use rollout.engine: hf"):
        check_served_names(["thinker.lm_head.weight", "model.layers.0.mlp.gate.weight"], wrapped, "sglang[0]")
    check_served_names(["thinker.lm_head.weight"], wrapped, "sglang[0]")  # the checkpoint's own names load
    check_served_names(["model.layers.0.mlp.gate.weight"], None, "sglang[0]")  # any other model: as sent
