"""The pure mappings: sampling params, per-token versions, finish reasons, the server command line."""

from __future__ import annotations

import json

import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.media import ImageSpec
from relax.sglang.params import SGLangEngineParams
from relax.sglang.payload import finish_reason, generate_payload, parse_output, token_versions
from relax.sglang.server import server_command


def test_payload_continues_the_prefix_with_the_remaining_budget():
    req = GenerationRequest(
        "r",
        [1, 2],
        SamplingParams(temperature=0.5, top_k=0, max_new_tokens=6, stop_token_ids=(9,), seed=4),
        prefix_response_ids=[5, 6],
    )
    body = generate_payload(req, "rid", [5, 6, 7])
    assert body["input_ids"] == [1, 2, 5, 6, 7]
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["top_k"], sp["stop_token_ids"], sp["sampling_seed"]) == (3, -1, [9], 4)
    assert body["return_logprob"] is True and "stop" not in sp


def test_token_versions_follow_the_spans():
    meta = {
        "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    }
    assert token_versions(meta, 5, default=0) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "default"}, 2, default=7) == [7, 7]


def test_parse_output_and_finish_reasons():
    out = {
        "output_ids": [4, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-0.5, 4, None], [-1.0, 2, None]],
            "weight_version": "1",
        },
    }
    assert parse_output(out, 0) == ([4, 2], [-0.5, -1.0], [1, 1], "stop")
    assert finish_reason({"finish_reason": {"type": "abort", "message": "x"}}) == "abort"
    with pytest.raises(ValueError, match="not stop, length or abort"):
        finish_reason({"finish_reason": None})
    out["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        parse_output(out, 0)


def test_server_command_passes_launch_settings_through():
    params = SGLangEngineParams(
        python="/env/bin/python", tp_size=1, extra_args=["--chunked-prefill-size", "64"]
    )
    cmd = server_command(params, "/m", 30001, "float32")
    assert cmd[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "/m" and cmd[cmd.index("--port") + 1] == "30001"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--attention-backend" in cmd
    assert cmd[-2:] == ["--chunked-prefill-size", "64"] and "--mm-process-config" not in cmd
    video = server_command(params, "/m", 30001, "float32", video="qwen2_5_vl")
    config = json.loads(video[video.index("--mm-process-config") + 1])["video"]
    assert config["fps"] == config["video_metadata"]["fps"] == params.video_fps and video[-2:] == cmd[-2:]
    own = SGLangEngineParams(extra_args=["--mm-process-config", "{}"])
    assert server_command(own, "/m", 1, "float32", video="qwen2_5_vl").count("--mm-process-config") == 1
    q3 = server_command(params, "/m", 1, "float32", video="qwen3_vl")
    qwen3 = json.loads(q3[q3.index("--mm-process-config") + 1])["video"]
    assert qwen3["fps"] == params.video_fps and "video_metadata" not in qwen3  # SGLang's own, with our times
    # the memory saver (rollout.release_memory) on CUDA only: SGLang's is CUDA-only; off on request
    saver = ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    gpu = server_command(SGLangEngineParams(device="cuda"), "/m", 1, "bfloat16")
    assert all(flag in gpu for flag in saver) and not any(flag in cmd for flag in saver)
    assert not any(
        f in server_command(SGLangEngineParams(device="cuda", memory_saver=False), "/m", 1, "bf16")
        for f in saver
    )


def test_params_validation_names_the_field():
    bad = SGLangEngineParams(tp_size=2, urls=["localhost:1"], max_concurrency=0)
    errors = " ".join(bad.validate())
    assert "tp_size" in errors and "urls" in errors and "max_concurrency" in errors


def test_stop_ids_cut_the_response_even_with_ignore_eos():
    from relax.sglang.payload import cut_at_stop_ids

    params = SamplingParams(ignore_eos=True, stop_token_ids=(5,))
    assert cut_at_stop_ids(params, [7, 5, 5, 9], [-1.0] * 4, [0] * 4, "length") == (
        [7, 5],
        [-1.0] * 2,
        [0] * 2,
        "stop",
    )
    assert cut_at_stop_ids(params, [7, 9], [-1.0] * 2, [0] * 2, "length")[3] == "length"


@pytest.fixture(scope="module")
def vl_prompt(tmp_path_factory):
    """(relax-omni processed prompt for one image, image spec) on the tiny Qwen2.5-VL processor (no weights)."""
    from relax.core.testing.multimodal import write_media
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.omni.tiny_models import build_processor, build_tokenizer

    hf = build_processor("qwen2_5_vl", build_tokenizer("qwen2_5_vl"))
    proc = QwenOmniProcessor(hf, FAMILIES["qwen2_5_vl"], OmniProcessorParams())
    media = write_media(tmp_path_factory.mktemp("vl_media"))
    content = [{"type": "image", "image": media["image"]}, {"type": "text", "text": "what?"}]
    prompt = proc.process([{"role": "user", "content": content}], [], "t.jsonl:1")
    ip = hf.image_processor
    spec = ImageSpec(
        hf.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        ip.patch_size,
        ip.merge_size,
        ip.temporal_patch_size,
        tuple(ip.image_mean),
        tuple(ip.image_std),
    )
    return prompt, spec, hf


def test_images_are_rebuilt_exactly_from_their_patches(vl_prompt):
    """The rebuilt image, processed again by the same HF processor, gives the same patches (what SGLang's
    processor does with it)."""
    import torch
    from PIL import Image

    from relax.sglang.media import images_from_patches

    prompt, spec, hf = vl_prompt
    inputs = prompt["inputs"]
    (image,) = images_from_patches(inputs["pixel_values"], inputs["image_grid_thw"], spec)
    again = hf.image_processor(images=[Image.fromarray(image)], return_tensors="pt")
    assert again["image_grid_thw"].tolist() == inputs["image_grid_thw"].tolist()
    assert (again["pixel_values"] - inputs["pixel_values"]).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match=r"pixel_values has \d+ rows, image_grid_thw accounts for"):
        images_from_patches(torch.cat([inputs["pixel_values"]] * 2), inputs["image_grid_thw"], spec)


def test_media_request_collapses_placeholders_and_sends_the_image(vl_prompt):
    from relax.sglang.media import media_request

    prompt, spec, _ = vl_prompt
    ids, pad = prompt["prompt_ids"], spec.image_token_id
    media = media_request(prompt["inputs"], ids, spec)
    assert ids.count(pad) > 1 and media.prompt_ids.count(pad) == 1
    assert media.prompt_ids == [t for i, t in enumerate(ids) if not (t == pad and ids[i - 1] == pad)]
    (url,) = media.fields["image_data"]
    assert url.startswith("data:image/png;base64,")
    body = generate_payload(GenerationRequest("m", ids, SamplingParams(max_new_tokens=3)), "rid", [7], media)
    assert body["input_ids"] == media.prompt_ids + [7] and body["image_data"] == [url]
    assert body["sampling_params"]["max_new_tokens"] == 2


def test_media_sglang_cannot_take_is_refused_by_name(vl_prompt):
    from relax.sglang.media import check_prompt_tokens, media_request

    prompt, spec, _ = vl_prompt
    with pytest.raises(
        ValueError, match=r"\['image_embeds'\]: the sglang engine sends images, videos and audio"
    ):
        media_request({**prompt["inputs"], "image_embeds": [0]}, [], spec)
    with pytest.raises(
        ValueError, match="input_features: audio features cannot be inverted and the processed prompt"
    ):
        media_request({**prompt["inputs"], "input_features": [0], "feature_attention_mask": [1]}, [], spec)
    with pytest.raises(ValueError, match="use_audio_in_video=False and takes no precomputed positions"):
        media_request({**prompt["inputs"], "use_audio_in_video": [1]}, [], spec)
    with pytest.raises(ValueError, match="prompt has 0 image placeholder runs for 1 images"):
        media_request(prompt["inputs"], [1, 2, 3], spec)
    check_prompt_tokens({"prompt_tokens": 27}, 27, "e")
    with pytest.raises(
        ValueError, match="e: SGLang expanded the media prompt to 26 tokens, the relax processor to 27"
    ):
        check_prompt_tokens({"prompt_tokens": 26}, 27, "e")


def test_a_groups_media_is_built_once(vl_prompt):
    from relax.sglang.engine import _media_requests

    prompt, spec, _ = vl_prompt
    shared, other = prompt["inputs"], dict(prompt["inputs"])
    ids = prompt["prompt_ids"]
    built = _media_requests([shared, None, shared, other], [ids, [1], ids, ids], spec)
    assert built[1] is None and built[0] is built[2] and built[3] is not built[0]
    assert built[3].fields == built[0].fields


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
def video_prompt(vl_prompt, tmp_path_factory):
    """relax-omni's processed prompt for one 2 s synthetic video (4 frames sampled at 2 fps: 2 temporal grids)."""
    from relax.omni import synthetic
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    _, spec, hf = vl_prompt
    path = tmp_path_factory.mktemp("video") / "dot.mp4"
    synthetic.moving_dot_video(path, right=True)
    proc = QwenOmniProcessor(hf, FAMILIES["qwen2_5_vl"], OmniProcessorParams())
    content = [{"type": "video", "video": str(path)}, {"type": "text", "text": "where?"}]
    prompt = proc.process([{"role": "user", "content": content}], [], "t.jsonl:2")
    pad = hf.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    video_spec = ImageSpec(**{**spec.__dict__, "video_token_id": pad, "model_type": "qwen2_5_vl"})
    return prompt, video_spec, hf


def test_video_frames_are_rebuilt_exactly_and_survive_the_container(video_prompt):
    """The sampled frames come back from the patches (the same HF processor gives the same patches) and
    through the FFV1 data URL unchanged, at the fps SGLang samples with (so it keeps every frame)."""
    import base64
    import io

    import decord
    import numpy as np

    from relax.sglang.media import frames_from_patches, video_data_url

    prompt, spec, hf = video_prompt
    inputs = prompt["inputs"]
    (frames,) = frames_from_patches(inputs["pixel_values_videos"], inputs["video_grid_thw"], spec)
    assert frames.shape[0] == 2 * int(inputs["video_grid_thw"][0, 0])
    size = {"shortest_edge": 1, "longest_edge": frames.shape[1] * frames.shape[2]}
    again = hf.video_processor(videos=[frames], size=size, do_sample_frames=False, return_tensors="pt")
    assert (again["pixel_values_videos"] - inputs["pixel_values_videos"]).abs().max().item() < 1e-6
    url = video_data_url(frames, 2.0)
    reader = decord.VideoReader(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert reader.get_avg_fps() == 2.0 and np.array_equal(
        reader.get_batch(list(range(len(reader)))).asnumpy(), frames
    )


def test_media_request_sends_one_video_at_the_servers_fps(video_prompt):
    import torch

    from relax.sglang.media import media_request

    prompt, spec, _ = video_prompt
    ids, inputs, pad = prompt["prompt_ids"], prompt["inputs"], spec.video_token_id
    media = media_request(inputs, ids, spec, video_fps=2.0)
    assert ids.count(pad) > 1 and media.prompt_ids.count(pad) == 1 and len(media.prompt_ids) < len(ids)
    (url,) = media.fields["video_data"]
    assert url.startswith("data:video/x-matroska;base64,") and "image_data" not in media.fields
    with pytest.raises(
        ValueError,
        match=r"video sampled at 2 fps \(second_per_grid_ts 1\), the SGLang server "
        "samples at engine_params.video_fps=1",
    ):
        media_request(inputs, ids, spec, video_fps=1.0)
    two = {**inputs, "second_per_grid_ts": torch.tensor([1.0, 1.0])}
    with pytest.raises(
        ValueError, match="2 videos in one prompt: SGLang 0.5.23 gives the qwen2_5_vl processor one"
    ):
        media_request(two, ids, spec)
    with pytest.raises(
        ValueError, match=r"model_type 'qwen2_5_omni_thinker': its model adapter declares no video layout"
    ):
        media_request(inputs, ids, ImageSpec(**{**spec.__dict__, "model_type": "qwen2_5_omni_thinker"}))
    with pytest.raises(ValueError, match="prompt has 0 video placeholder runs for 1 videos"):
        media_request(inputs, [1, 2], spec)


def test_qwen3_vl_video_blocks_collapse_and_their_times_go_in_the_container(tmp_path):
    """A Qwen3-VL prompt of two videos: each ``<vs> (<t seconds><vs> pads <ve>)... <ve>`` block becomes the
    template's ``<vs> pad <ve>``, and each video's container carries its frames (re-processed by the HF video
    processor to the same patches) and the times its block wrote, in order."""
    import base64
    import io

    import av
    import numpy as np

    from relax.omni import synthetic
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.omni.tiny_models import build_processor, build_tokenizer
    from relax.sglang.media import TIMESTAMPS_TAG, frames_from_patches, media_request

    hf = build_processor("qwen3_vl", build_tokenizer("qwen3_vl"))
    proc = QwenOmniProcessor(hf, FAMILIES["qwen3_vl"], OmniProcessorParams(max_frames=64))
    synthetic.moving_dot_video(tmp_path / "a.mp4", right=True, frames=4)
    synthetic.moving_dot_video(tmp_path / "b.mp4", right=False, frames=8)
    content = [
        {"type": "video", "video": str(tmp_path / "a.mp4")},
        {"type": "text", "text": "and"},
        {"type": "video", "video": str(tmp_path / "b.mp4")},
    ]
    prompt = proc.process([{"role": "user", "content": content}], [], "t.jsonl:4")
    ids, inputs, tok = prompt["prompt_ids"], prompt["inputs"], hf.tokenizer
    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    vp = hf.video_processor
    spec = ImageSpec(
        tok.convert_tokens_to_ids("<|image_pad|>"),
        16,
        2,
        2,
        (0.5,) * 3,
        (0.5,) * 3,
        video_token_id=pad,
        model_type="qwen3_vl",
        video_mean=tuple(vp.image_mean),
        video_std=tuple(vp.image_std),
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    media = media_request(inputs, ids, spec, decode=tok.decode)
    text = tok.decode(media.prompt_ids)
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 2 and "seconds>" not in text
    written = [t.split(" ")[0] for t in tok.decode(ids).split("<")[1:] if t.endswith("seconds>")]
    assert len(written) == int(inputs["video_grid_thw"][:, 0].sum())

    def container(url):
        with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as c:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
            return frames, c.metadata[TIMESTAMPS_TAG].split(",")

    sent = [container(url) for url in media.fields["video_data"]]
    assert [t for _, stamps in sent for t in stamps] == written
    for (frames, _), want in zip(
        sent,
        frames_from_patches(
            inputs["pixel_values_videos"], inputs["video_grid_thw"], spec, "pixel_values_videos"
        ),
        strict=True,
    ):
        assert np.array_equal(frames, want)
    again = vp(videos=[f for f, _ in sent], do_sample_frames=False, do_resize=False, return_tensors="pt")
    assert (again["pixel_values_videos"] - inputs["pixel_values_videos"]).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="need the tokenizer"):
        media_request(inputs, ids, spec)
    broken = [t if t != start else end for t in ids]  # no vision_start before the frames
    with pytest.raises(ValueError, match=r"is not <t seconds><vision_start>pads<vision_end>"):
        media_request(inputs, broken, spec, decode=tok.decode)


def test_audio_goes_as_the_lossless_waveform(tmp_path):
    """The waveform comes back bit-exact from the data URL (PyAV, as SGLang decodes it), and an audio prompt
    processed by relax-omni is sent with its kept waveform (``source.audio.0``, the exact array its features
    came from) and its placeholder runs collapsed -- through the engine's request builder too -- or refused
    without a waveform."""
    import base64
    import io

    import av
    import numpy as np

    from relax.core.data_multimodal import model_inputs
    from relax.core.testing.multimodal import write_media
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.omni.tiny_models import build_processor, build_tokenizer
    from relax.sglang.engine import _media_requests
    from relax.sglang.media import audio_data_url, media_request

    def decoded(url: str) -> np.ndarray:
        with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as container:
            stream = container.streams.audio[0]
            assert stream.rate == 16000
            return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])

    wave = (0.3 * np.sin(np.arange(8000) / 7.0)).astype(np.float32)
    back = decoded(audio_data_url(wave, 16000))
    assert back.dtype == np.float32 and np.array_equal(back, wave)

    hf = build_processor("qwen3_omni", build_tokenizer("qwen3_omni"))
    proc = QwenOmniProcessor(hf, FAMILIES["qwen3_omni"], OmniProcessorParams())
    content = [{"type": "audio", "audio": write_media(tmp_path)["audio"]}, {"type": "text", "text": "what?"}]
    prompt = proc.process([{"role": "user", "content": content}], [], "t.jsonl:3")
    pad = hf.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    spec = ImageSpec(
        hf.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        16,
        2,
        2,
        (0.5,) * 3,
        (0.5,) * 3,
        audio_token_id=pad,
        model_type="qwen3_omni_moe_thinker",
    )
    ids, inputs = prompt["prompt_ids"], prompt["inputs"]
    media = media_request(inputs, ids, spec)  # at the rate relax-omni's adapter declares (ServingConventions)
    with pytest.raises(
        ValueError, match="model_type 'qwen3_vl', whose model adapter declares no audio sample rate"
    ):
        media_request(inputs, ids, ImageSpec(**{**spec.__dict__, "model_type": "qwen3_vl"}))
    assert ids.count(pad) > 1 and media.prompt_ids.count(pad) == 1 and list(media.fields) == ["audio_data"]
    (sent,) = media.fields["audio_data"]
    assert np.array_equal(decoded(sent), inputs["source.audio.0"].numpy())
    (built,) = _media_requests([inputs], [ids], spec)  # the engine's path
    assert built.prompt_ids == media.prompt_ids and np.array_equal(
        decoded(built.fields["audio_data"][0]), decoded(sent)
    )
    assert np.array_equal(
        decoded(media_request(inputs, ids, spec, audios=[wave]).fields["audio_data"][0]), wave
    )
    with pytest.raises(ValueError, match="prompt has 1 audio placeholder runs for 2 audios"):
        media_request(inputs, ids, spec, audios=[wave, wave])
    with pytest.raises(ValueError, match=r"carries no waveform \(source.audio.<i>, kept by relax-omni"):
        media_request(model_inputs(inputs), ids, spec)
