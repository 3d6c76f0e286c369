"""The four Qwen-VL / Qwen-Omni processors on their tiny locally built models: media rows -> prompt + inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax.core.context import PluginContext
from relax.core.processors import MediaError, MultimodalProcessor
from relax.core.testing import ProcessorConformance
from relax.omni.processors import OmniProcessorParams, make_factory
from relax.omni.tiny_models import FAMILIES, PLACEHOLDERS, tiny_multimodal_dir

PARAMS = OmniProcessorParams(
    min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=28 * 28, video_max_pixels=56 * 56, max_frames=4
)


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {
        f: make_factory(f)(PARAMS, PluginContext(role="processor", model_path=tiny_multimodal_dir(root, f)))
        for f in FAMILIES
    }


def merged_tokens(grid: torch.Tensor) -> int:
    return int(grid.prod(-1).sum()) // 4  # 2x2 spatial merge


@pytest.mark.parametrize("family", FAMILIES)
def test_media_rows_become_prompt_ids_and_model_inputs(processors, media, family):
    proc = processors[family]
    assert isinstance(proc, MultimodalProcessor) and proc.multimodal
    omni = "omni" in family
    content = [
        {"type": "image", "image": str(media / "circles.png")},
        {"type": "video", "video": str(media / "dot.mp4")},
    ]
    if omni:
        content.append({"type": "audio", "audio": str(media / "tones.wav")})
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "how many circles?"}]}]
    out = proc.process(messages, [], "t.jsonl:1")
    assert out["counts"] == {"image": 1, "video": 1, "audio": int(omni)}
    inputs, ids = out["inputs"], out["prompt_ids"]
    assert "input_ids" not in inputs and "attention_mask" not in inputs
    tok = proc.tokenizer
    pads = {kind: tok.convert_tokens_to_ids(toks[1]) for kind, toks in PLACEHOLDERS[family].items()}
    assert ids.count(pads["image"]) == merged_tokens(inputs["image_grid_thw"])
    assert ids.count(pads["video"]) == merged_tokens(inputs["video_grid_thw"])
    assert inputs["video_grid_thw"][0, 0] == 2  # max_frames=4 frames, paired
    if omni:
        assert inputs["input_features"].shape[:2] == (1, 128) and ids.count(pads["audio"]) > 0
    # prompt_text is the template text (one placeholder per item); prompt_ids hold the expanded placeholders
    # (and, for Qwen3-VL, the frame timestamps the processor writes)
    tail = "how many circles?<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_text"].endswith(tail) and tok.decode(ids).endswith(tail)
    assert out["prompt_text"].count(PLACEHOLDERS[family]["image"][1]) == 1
    # deterministic, and column media give the same prompt as inline content items
    refs = [{"key": c["type"], "ref": c[c["type"]]} for c in content]
    again = proc.process([{"role": "user", "content": "how many circles?"}], refs, "t.jsonl:2")
    assert again["prompt_ids"] == ids and again["counts"] == out["counts"]
    assert inputs.keys() == again["inputs"].keys()
    assert all(torch.equal(inputs[k], again["inputs"][k]) for k in inputs)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_waveforms_are_kept_beside_the_features(
    processors, media, family, tmp_path, assert_source_audio
):
    """Each audio item's decoded 16 kHz waveform is kept as ``source.audio.<i>`` in prompt order (for engines
    that re-process media): the HF feature extractor gives exactly the row's ``input_features`` from them."""
    from relax.omni import synthetic

    synthetic.two_tones(tmp_path / "long.wav", 330.0, 550.0, seconds=0.4)
    content = [
        {"type": "audio", "audio": str(tmp_path / "long.wav")},
        {"type": "text", "text": "and"},
        {"type": "audio", "audio": str(media / "tones.wav")},
        {"type": "text", "text": "same?"},
    ]
    inputs = processors[family].process([{"role": "user", "content": content}], [], "t.jsonl:1")["inputs"]
    assert_source_audio(processors[family], inputs, 2)
    assert [len(inputs[f"source.audio.{i}"]) for i in (0, 1)] == [
        2 * 6400,
        2 * 4000,
    ]  # 2 tones of 0.4 s, 0.25 s
    image_only = [{"type": "image", "image": str(media / "circles.png")}, {"type": "text", "text": "?"}]
    out = processors[family].process([{"role": "user", "content": image_only}], [], "t.jsonl:2")
    assert not any(k.startswith("source.") for k in out["inputs"])


def test_vl_processors_refuse_audio_and_mismatched_model(processors, media, tmp_path_factory):
    with pytest.raises(
        MediaError, match=r"t:1: messages\[0\].content\[0\] audio .*wrong type: this model takes"
    ):
        processors["qwen2_5_vl"].process(
            [{"role": "user", "content": [{"type": "audio", "audio": str(media / "tones.wav")}]}], [], "t:1"
        )
    vl_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    with pytest.raises(
        ValueError,
        match="data.processor 'qwen3_omni' needs a Qwen3OmniMoeProcessor beside the model, "
        "found Qwen2_5_VLProcessor",
    ):
        make_factory("qwen3_omni")(PARAMS, SimpleNamespace(tokenizer_path=None, model_path=vl_dir))


def test_registered_through_the_processor_hook():
    from relax.core.plugins import get_plugin_manager

    pm = get_plugin_manager()
    for family in FAMILIES:
        reg = pm.registration("processor", family)
        assert reg.plugin == "omni" and reg.config is OmniProcessorParams, reg


class _FamilyConformance(ProcessorConformance):
    family = "qwen2_5_vl"

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        return tiny_multimodal_dir(tmp_path_factory.getbasetemp(), cls.family)

    def make_processor(self, model_dir):
        return make_factory(self.family)(PARAMS, PluginContext(role="processor", model_path=model_dir))


class TestQwen25VLConformance(_FamilyConformance):
    family = "qwen2_5_vl"


class TestQwen3VLConformance(_FamilyConformance):
    family = "qwen3_vl"


class TestQwen25OmniConformance(_FamilyConformance):
    family = "qwen2_5_omni"


class TestQwen3OmniConformance(_FamilyConformance):
    family = "qwen3_omni"
