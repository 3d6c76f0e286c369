"""The omni quick-starts' inputs (``relax.omni.quickstart``): registered through ``relax_register_inputs``, cached
under a fingerprint of their recipe, and an unusable cache names the way out. Building them (once, then reused)
and learning from them: integration_tests/test_omni_examples.py, which shares one build with its runs."""

from __future__ import annotations

import pytest

from relax.core.plugins import get_plugin_manager
from relax.omni.quickstart import (
    PREPARE,
    QUICKSTARTS,
    OmniQuickstartParams,
    ensure_quickstart,
    fingerprint,
)


def test_both_quickstarts_are_registered_inputs_that_fill_model_and_data():
    for name in ("omni_vl_quickstart", "omni_audio_quickstart"):
        reg = get_plugin_manager().registration("inputs", name)
        assert reg.plugin == "omni" and reg.config is OmniQuickstartParams
        assert reg.options["fills"] == ("model.path", "data.path")


def test_the_cache_directory_is_named_by_the_recipe():
    vl, audio = QUICKSTARTS["omni_vl_quickstart"], QUICKSTARTS["omni_audio_quickstart"]
    assert fingerprint(vl, 192, 0) == fingerprint(vl, 192, 0)
    assert (
        len(
            {
                fingerprint(vl, 192, 0),
                fingerprint(vl, 96, 0),
                fingerprint(vl, 192, 1),
                fingerprint(audio, 192, 0),
            }
        )
        == 4
    )


def test_an_unusable_cache_names_the_way_out(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        OSError,
        match=rf"inputs 'omni_vl_quickstart': cannot build under .*a-file.*RELAX_CACHE_DIR.*{PREPARE} --cache-dir",
    ):
        ensure_quickstart("omni_vl_quickstart", cache_dir=blocker / "sub")
    with pytest.raises(
        ValueError,
        match=r"unknown omni quick-start 'omni_nope'; choose one of \['omni_audio_quickstart', 'omni_vl_quickstart'\]",
    ):
        ensure_quickstart("omni_nope")


def test_a_damaged_build_names_what_it_lacks_and_how_to_rebuild(tmp_path):
    target = tmp_path / f"omni-vl-quickstart-{fingerprint(QUICKSTARTS['omni_vl_quickstart'], 192, 0)}"
    (target / "model").mkdir(parents=True)
    (target / "model" / "config.json").write_text("{}")
    with pytest.raises(
        FileNotFoundError,
        match=r"lacks model/model.safetensors, model/tokenizer.json, data/train.jsonl; remove that directory and run again",
    ):
        ensure_quickstart("omni_vl_quickstart", cache_dir=tmp_path)
