"""The pure mappings: sampling params, per-token versions, finish reasons, the server command line."""

from __future__ import annotations

import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.params import SGLangEngineParams
from relax.sglang.payload import finish_reason, generate_payload, parse_output, token_versions
from relax.sglang.server import server_command


def test_payload_continues_the_prefix_with_the_remaining_budget():
    req = GenerationRequest(
        "r", [1, 2], SamplingParams(temperature=0.5, top_k=0, max_new_tokens=6, stop_token_ids=(9,), seed=4),
        prefix_response_ids=[5, 6],
    )  # fmt: skip
    body = generate_payload(req, "rid", [5, 6, 7])
    assert body["input_ids"] == [1, 2, 5, 6, 7]
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["top_k"], sp["stop_token_ids"], sp["sampling_seed"]) == (3, -1, [9], 4)
    assert body["return_logprob"] is True and "stop" not in sp


def test_token_versions_follow_the_spans():
    meta = {"weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]}
    assert token_versions(meta, 5, default=0) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "default"}, 2, default=7) == [7, 7]


def test_parse_output_and_finish_reasons():
    out = {"output_ids": [4, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
           "output_token_logprobs": [[-0.5, 4, None], [-1.0, 2, None]], "weight_version": "1"}}  # fmt: skip
    assert parse_output(out, 0) == ([4, 2], [-0.5, -1.0], [1, 1], "stop")
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}}) == "abort"
    with pytest.raises(ValueError, match="not stop, length or abort"):
        finish_reason({"finish_reason": None})
    out["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        parse_output(out, 0)


def test_server_command_passes_launch_settings_through():
    params = SGLangEngineParams(python="/env/bin/python", tp_size=1, extra_args=["--chunked-prefill-size", "64"])
    cmd = server_command(params, "/m", 30001, "float32")
    assert cmd[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[cmd.index("--port") + 1] == "30001"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--attention-backend" in cmd
    assert cmd[-2:] == ["--chunked-prefill-size", "64"]


def test_params_validation_names_the_field():
    bad = SGLangEngineParams(tp_size=2, urls=["localhost:1"], max_concurrency=0)
    errors = " ".join(bad.validate())
    assert "tp_size" in errors and "urls" in errors and "max_concurrency" in errors


def test_stop_ids_cut_the_response_even_with_ignore_eos():
    from relax.sglang.payload import cut_at_stop_ids

    params = SamplingParams(ignore_eos=True, stop_token_ids=(5,))
    assert cut_at_stop_ids(params, [7, 5, 5, 9], [-1.0] * 4, [0] * 4, "length") == ([7, 5], [-1.0] * 2, [0] * 2, "stop")
    assert cut_at_stop_ids(params, [7, 9], [-1.0] * 2, [0] * 2, "length")[3] == "length"


def _image_inputs(seed: int) -> dict:
    """A relax-omni processor's ``inputs`` for one image (Qwen-VL shapes: 4 patches of 2 floats, a 1x2x2 grid)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(4, 2, generator=gen), "image_grid_thw": torch.tensor([[1, 2, 2]]),
            "mm_token_type_ids": torch.tensor([[0, 1, 1, 0]])}  # fmt: skip


def test_media_payload_sends_one_processor_output_item_per_modality():
    from relax.sglang.payload import media_payload

    inputs = {**_image_inputs(0), "input_features": [[0.5, 0.25]], "feature_attention_mask": [[1]]}
    fields = media_payload(inputs)
    assert sorted(fields) == ["audio_data", "image_data"]
    (image,) = fields["image_data"]
    assert image["format"] == "processor_output" and image["modality"] == "image"
    assert image["pixel_values"] == inputs["pixel_values"].tolist() and image["image_grid_thw"] == [[1, 2, 2]]
    assert "mm_token_type_ids" not in image  # recomputed by SGLang from the ids
    assert fields["audio_data"] == [{"format": "processor_output", "modality": "audio",
                                     "input_features": [[0.5, 0.25]], "feature_attention_mask": [[1]]}]  # fmt: skip
    req = GenerationRequest("m", [1, 2], SamplingParams(max_new_tokens=3))
    body = generate_payload(req, "rid", [7], fields)
    assert body["image_data"] is fields["image_data"] and body["input_ids"] == [1, 2, 7]
    with pytest.raises(ValueError, match=r"media inputs \['pixel_attention_mask'\] have no SGLang /generate field"):
        media_payload({"pixel_attention_mask": [1]})


def test_a_groups_media_is_converted_once():
    from relax.sglang.engine import _media_fields

    shared, other = _image_inputs(1), _image_inputs(2)
    fields = _media_fields([shared, None, shared, other])
    assert fields[1] is None and fields[0] is fields[2] and fields[3] is not fields[0]
    assert fields[3]["image_data"][0]["pixel_values"] == other["pixel_values"].tolist()


def test_the_engine_declares_its_attach_field_for_scale_out_by_url():
    """Core's scale-out by URL starts an engine with ``engine_params.urls = [url]`` (and no launch)."""
    from relax.core.config import load_config
    from relax.core.controller.fleet import attach_param, with_engine_params

    assert attach_param("sglang") == "urls"
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.engine_params.python=/env/bin/python"])
    params = with_engine_params(cfg, {"urls": ["http://10.0.0.2:30000"]}).rollout.engine_params
    assert isinstance(params, SGLangEngineParams) and params.urls == ["http://10.0.0.2:30000"]
    assert params.python == "/env/bin/python" and cfg.rollout.engine_params.urls == []


@pytest.fixture(scope="module")
def omni_media(tmp_path_factory):
    """A still image and a video with a soundtrack (``relax.omni.synthetic``; the soundtrack needs ffmpeg)."""
    import shutil

    if shutil.which("ffmpeg") is None:
        pytest.skip("a video with a soundtrack needs ffmpeg")
    from relax.omni import synthetic

    d = tmp_path_factory.mktemp("omni_media")
    synthetic.circles_image(d / "circles.png", 2)
    synthetic.moving_dot_video(d / "dot_sound.mp4", right=False, tone_hz=330.0)
    return d


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_omni_processor_outputs_reach_sglang_under_its_names(family, omni_media):
    """Real relax-omni outputs (tiny processor built locally) for image + video-with-soundtrack: the
    seconds per temporal grid go out as SGLang's ``second_per_grid_ts`` (also on the first item, where
    SGLang's rope index reads it) and the per-video flags as the request's ``use_audio_in_video``."""
    import json

    import torch

    from relax.core.testing.multimodal_models import build_processor, build_tokenizer
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.sglang.payload import media_payload

    params = OmniProcessorParams(min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=28 * 28,
                                 video_max_pixels=56 * 56, max_frames=4, use_audio_in_video=True)  # fmt: skip
    proc = QwenOmniProcessor(build_processor(family, build_tokenizer(family)), FAMILIES[family], params)
    content = [{"type": "image", "image": str(omni_media / "circles.png")},
               {"type": "video", "video": str(omni_media / "dot_sound.mp4")}, {"type": "text", "text": "which way?"}]  # fmt: skip
    inputs = proc.process([{"role": "user", "content": content}], [], "t.jsonl:1")["inputs"]
    assert "video_second_per_grid" in inputs and inputs["use_audio_in_video"].tolist() == [1]

    fields = media_payload(inputs)
    assert sorted(fields) == ["audio_data", "image_data", "use_audio_in_video", "video_data"]
    assert fields["use_audio_in_video"] is True
    (image,), (video,), (audio,) = fields["image_data"], fields["video_data"], fields["audio_data"]
    seconds = inputs["video_second_per_grid"].tolist()
    assert video["second_per_grid_ts"] == seconds and "video_second_per_grid" not in video
    assert image["second_per_grid_ts"] == seconds  # SGLang reads it from the first item only
    assert video["video_grid_thw"] == inputs["video_grid_thw"].tolist()
    assert audio["input_features"] == inputs["input_features"].tolist()
    assert audio["feature_attention_mask"] == inputs["feature_attention_mask"].tolist()
    body = json.loads(json.dumps(generate_payload(GenerationRequest("o", [1], SamplingParams()), "rid", [], fields)))
    assert body["use_audio_in_video"] is True and body["video_data"][0]["modality"] == "video"

    plain = {k: v for k, v in inputs.items() if k not in ("use_audio_in_video", "pixel_values", "image_grid_thw")}
    fields = media_payload(plain)  # no flag: no request-level field; the video item comes first itself
    assert "use_audio_in_video" not in fields and fields["video_data"][0]["second_per_grid_ts"] == seconds
    mixed = {**inputs, "video_grid_thw": torch.cat([inputs["video_grid_thw"]] * 2),
             "use_audio_in_video": torch.tensor([1, 0])}  # fmt: skip
    with pytest.raises(ValueError, match=r"use_audio_in_video \[1, 0\] for 2 videos: SGLang takes one"):
        media_payload(mixed)
