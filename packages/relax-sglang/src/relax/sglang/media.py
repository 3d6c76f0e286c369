"""Media requests for SGLang over HTTP: images and videos rebuilt from the processed patches, placeholders
collapsed.

SGLang 0.5.23's ``/generate`` rejects processed tensors over HTTP (its ``image_data`` schema has no
``format``/``processor_output`` field: "unknown field `format`"), so a request carries raw media that
SGLang's own (HF) processor re-processes. relax-omni already resized each image / sampled video frame to
its patch grid, so its ``pixel_values`` / ``pixel_values_videos`` are exactly ``(uint8 / 255 - mean) / std``
of those pixels: inverting them gives the image (PNG) or the sampled frames back losslessly, SGLang's
processor then yields the same patches and expands each collapsed placeholder to the same run of tokens.

Videos go as lossless FFV1/Matroska data URLs of exactly the sampled frames, encoded at the server's
sampling fps (``engine_params.video_fps``) so that SGLang keeps every frame. SGLang 0.5.23 hands the
Qwen2.5-VL HF processor no video metadata (so no fps, so ``second_per_grid_ts`` would be 2/24); the
launched server therefore gets ``--mm-process-config`` (``video_server_args``) with that fps as a
server-wide metadata, a pixel range that keeps the frames' size, and the same sampling fps. That holds one
video per prompt, at ``video_fps``: anything else is refused by name. Qwen3-VL videos (timestamps in the
text, re-derived by SGLang from the container) and other families' videos are refused.

Audio features cannot be inverted: audio goes as the decoded 16 kHz waveform (float32 PCM in Matroska,
lossless; SGLang decodes it with PyAV). relax-omni keeps each prompt's waveforms beside the features as
``source.audio.<i>`` (``relax.core.data_multimodal.SOURCE``), which ``media_request`` sends; processed
inputs without them (another processor) are refused by name.

The engine checks that SGLang's prompt length equals ours (``check_prompt_tokens``), since the trainer
trains on OUR ids. Audio-in-video rows would get wrong M-RoPE positions (SGLang 0.5.23 builds the index
with ``use_audio_in_video=False`` and takes no precomputed positions over HTTP): refused too.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax.core.data_multimodal import model_inputs, source_media
from relax.core.multimodal_model import AUDIO_IN_VIDEO

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
AUDIO_KEYS = ("input_features", "feature_attention_mask")
AUDIO_RATE = 16000  # what relax-omni decodes to and SGLang resamples to
IGNORED = ("mm_token_type_ids",)  # recomputed by SGLang from the ids
MAX_VIDEO_PIXELS = 16384 * 28 * 28  # per frame: far above any relax-omni budget (frames keep their size)
VIDEO_MODEL_TYPES = ("qwen2_5_vl",)  # whose video requests SGLang re-processes exactly (tested)


@dataclass(frozen=True)
class ImageSpec:
    """How the model's image processor cut images into patches (from the model directory)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    video_token_id: int | None = None  # None: the model takes no video
    audio_token_id: int | None = None  # None: the model takes no audio
    model_type: str = ""


def load_image_spec(model_dir: str) -> ImageSpec | None:
    """The spec from ``config.json`` + ``processor_config.json`` / ``preprocessor_config.json``; None for a
    model without an image token (text-only)."""
    root = Path(model_dir)
    config = _model_config(root)
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        return None
    proc: dict[str, Any] = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (root / name).exists():
            data = json.loads((root / name).read_text())
            proc = data.get("image_processor", data)
            break
    return ImageSpec(
        image_token_id=int(token),
        patch_size=int(proc.get("patch_size", 14)),
        merge_size=int(proc.get("merge_size", 2)),
        temporal_patch_size=int(proc.get("temporal_patch_size", 2)),
        image_mean=tuple(proc.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=tuple(proc.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        video_token_id=config.get("video_token_id"),
        audio_token_id=config.get("audio_token_id"),
        model_type=str(config.get("model_type", "")),
    )


def _model_config(root: Path) -> dict[str, Any]:
    """``config.json``, or its ``thinker_config`` (a Qwen-Omni checkpoint: the thinker reads the media)."""
    config = json.loads((root / "config.json").read_text())
    return config.get("thinker_config", config)


def serves_video(model_dir: str) -> bool:
    """Whether the engine sends the model video (``VIDEO_MODEL_TYPES``): its server gets ``video_server_args``."""
    root = Path(model_dir)
    return (root / "config.json").exists() and _model_config(root).get("model_type") in VIDEO_MODEL_TYPES


def video_server_args(video_fps: float) -> list[str]:
    """``sglang.launch_server`` arguments under which SGLang re-processes our rebuilt video frames exactly:
    sample at ``video_fps`` (the container's rate: every frame kept), keep each frame's size (in SGLang's
    resize and the HF processor's), and give the HF processor ``video_fps`` as the metadata it otherwise
    lacks (M-RoPE seconds per temporal grid)."""
    pixels = {"min_pixels": 1, "max_pixels": MAX_VIDEO_PIXELS}
    video = {"fps": video_fps, **pixels, "size": {"shortest_edge": 1, "longest_edge": MAX_VIDEO_PIXELS},
             "video_metadata": {"fps": video_fps, "total_num_frames": 1}}  # fmt: skip
    return ["--mm-process-config", json.dumps({"video": video})]


def frames_from_patches(pixel_values: Any, grid_thw: Any, spec: ImageSpec, what: str = "pixel_values") -> list[np.ndarray]:
    """Per item, the (T * temporal_patch_size, H, W, 3) uint8 frames whose Qwen-VL patches are
    ``pixel_values`` (inverse of the HF processor's patchify + normalize); ``what`` names the inputs in errors."""
    x = np.asarray(pixel_values, dtype=np.float64)
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    mean, std = np.asarray(spec.image_mean)[:, None, None], np.asarray(spec.image_std)[:, None, None]
    grid = "video_grid_thw" if what.endswith("videos") else "image_grid_thw"
    items, start = [], 0
    for t, gh, gw in grids.tolist():
        n = t * gh * gw
        chunk = x[start:start + n]
        start += n
        if chunk.shape != (n, 3 * tp * p * p):
            raise ValueError(f"{what} rows {chunk.shape} do not match {grid} {(t, gh, gw)} and patch "
                             f"size {p} x temporal {tp}")  # fmt: skip
        chunk = chunk.reshape(t, gh // m, gw // m, m, m, 3, tp, p, p).transpose(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frames = chunk.reshape(t * tp, 3, gh * p, gw * p)
        pixels = np.clip(np.rint((frames * std + mean) * 255.0), 0, 255).astype(np.uint8)
        items.append(pixels.transpose(0, 2, 3, 1))
    if start != len(x):
        raise ValueError(f"{what} has {len(x)} rows, {grid} accounts for {start}")
    return items


def images_from_patches(pixel_values: Any, grid_thw: Any, spec: ImageSpec) -> list[np.ndarray]:
    """The (H, W, 3) uint8 images whose patches are ``pixel_values`` (the first temporal copy of each)."""
    return [frames[0] for frames in frames_from_patches(pixel_values, grid_thw, spec)]


def png_data_url(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _av() -> Any:
    try:
        import av  # PyAV: installed with relax-omni (qwen-omni-utils), which made the media
    except ImportError as exc:
        raise ValueError("video and audio requests to SGLang need PyAV (pip install av) to encode them") from exc
    return av


def video_data_url(frames: np.ndarray, fps: float) -> str:
    """``frames`` (T, H, W, 3 uint8) as a lossless FFV1/Matroska data URL at ``fps`` (decoded back to the
    same pixels by SGLang's decord/torchcodec reader)."""
    from fractions import Fraction

    av = _av()
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return "data:video/x-matroska;base64," + base64.b64encode(buf.getvalue()).decode()


def audio_data_url(waveform: np.ndarray) -> str:
    """A mono ``AUDIO_RATE`` waveform as float32 PCM in a Matroska data URL: lossless, and a container that
    SGLang decodes with PyAV (its WAV path needs torchaudio, absent from the CPU server env)."""
    av = _av()
    samples = np.ascontiguousarray(np.asarray(waveform, dtype=np.float32).reshape(1, -1))
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("pcm_f32le", rate=AUDIO_RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = AUDIO_RATE
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return "data:audio/x-matroska;base64," + base64.b64encode(buf.getvalue()).decode()


def collapse_runs(ids: list[int], token_id: int) -> list[int]:
    """``ids`` with every run of ``token_id`` shortened to one token (the unexpanded placeholder)."""
    out: list[int] = []
    for t in ids:
        if not (t == token_id and out and out[-1] == token_id):
            out.append(t)
    return out


@dataclass(frozen=True)
class MediaRequest:
    """A prompt's media as SGLang takes it over HTTP: the collapsed prompt ids and the ``/generate`` fields."""

    prompt_ids: list[int]
    fields: dict[str, Any]


def media_request(
    inputs: dict[str, Any], prompt_ids: list[int], spec: ImageSpec | None, video_fps: float = 2.0,
    audios: list[np.ndarray] | None = None,
) -> MediaRequest:
    """The HTTP form of one prompt's processed media (see the module docstring); what SGLang cannot take
    exactly is an error naming it. ``video_fps``: the server's video sampling fps (``video_server_args``);
    ``audios``: the prompt's decoded waveforms, in order (its ``input_features`` cannot be inverted); by
    default its ``source.audio.<i>`` entries."""
    if audios is None:
        audios = source_media(inputs, "audio") or None
    inputs = model_inputs(inputs)
    unsupported = sorted(set(inputs) - set(IMAGE_KEYS) - set(VIDEO_KEYS) - set(AUDIO_KEYS) - set(IGNORED))
    if AUDIO_IN_VIDEO in unsupported:
        raise ValueError(
            "media inputs use_audio_in_video: SGLang 0.5.23 builds M-RoPE positions with use_audio_in_video=False "
            "and takes no precomputed positions over HTTP, so these rows would get wrong positions; use the hf "
            "engine for audio-in-video prompts"
        )
    if unsupported:
        raise ValueError(
            f"media inputs {unsupported}: the sglang engine sends images, Qwen2.5-VL videos and audio waveforms "
            "only (SGLang 0.5.23 takes no processed tensors over HTTP); use the hf engine for them"
        )
    if "input_features" in inputs and audios is None:
        raise ValueError(
            "media inputs input_features: audio features cannot be inverted and the processed prompt carries no "
            "waveform (source.audio.<i>, kept by relax-omni's processors), which SGLang needs; use the hf engine "
            "for audio prompts processed otherwise"
        )
    if spec is None:
        raise ValueError("media inputs for a model without image_token_id in its config.json")
    ids, fields = list(prompt_ids), {}
    if "pixel_values" in inputs:
        images = images_from_patches(inputs["pixel_values"], inputs["image_grid_thw"], spec)
        ids = _collapsed(ids, spec.image_token_id, len(images), "image")
        fields["image_data"] = [png_data_url(im) for im in images]
    if "pixel_values_videos" in inputs:
        videos = _videos(inputs, spec, video_fps)
        ids = _collapsed(ids, spec.video_token_id, len(videos), "video")
        fields["video_data"] = [video_data_url(frames, video_fps) for frames in videos]
    if "input_features" in inputs:
        if spec.audio_token_id is None:
            raise ValueError("audio inputs for a model without audio_token_id in its config.json")
        ids = _collapsed(ids, spec.audio_token_id, len(audios), "audio")
        fields["audio_data"] = [audio_data_url(w) for w in audios]
    return MediaRequest(ids, fields)


def _collapsed(ids: list[int], token_id: int, items: int, kind: str) -> list[int]:
    collapsed = collapse_runs(ids, token_id)
    if collapsed.count(token_id) != items:
        raise ValueError(f"prompt has {collapsed.count(token_id)} {kind} placeholder runs for {items} {kind}s")
    return collapsed


def _videos(inputs: dict[str, Any], spec: ImageSpec, video_fps: float) -> list[np.ndarray]:
    """The sampled frames of the prompt's one video, after checking SGLang can take it exactly."""
    if spec.model_type not in VIDEO_MODEL_TYPES or spec.video_token_id is None:
        raise ValueError(
            f"video inputs for model_type {spec.model_type!r}: the sglang engine sends {list(VIDEO_MODEL_TYPES)} "
            "videos only (Qwen3-VL puts per-frame timestamps in the prompt text, which SGLang 0.5.23 re-derives "
            "from the container it decodes); use the hf engine for these videos"
        )
    seconds = [float(s) for s in np.asarray(inputs.get("second_per_grid_ts", []), dtype=np.float64).reshape(-1)]
    if len(seconds) != 1:
        raise ValueError(
            f"{len(seconds)} videos in one prompt: SGLang 0.5.23 gives the Qwen2.5-VL processor one server-wide "
            "fps (--mm-process-config), which holds one video per prompt; use the hf engine for these prompts"
        )
    expected = spec.temporal_patch_size / video_fps
    if abs(seconds[0] - expected) > 1e-4 * expected:
        raise ValueError(
            f"video sampled at {spec.temporal_patch_size / seconds[0]:g} fps (second_per_grid_ts {seconds[0]:g}), "
            f"the SGLang server samples at engine_params.video_fps={video_fps:g}: M-RoPE times would differ; set "
            "data.processor_params.fps and engine_params.video_fps alike (a short video may get another fps)"
        )
    return frames_from_patches(inputs["pixel_values_videos"], inputs["video_grid_thw"], spec, "pixel_values_videos")


def check_prompt_tokens(meta: dict[str, Any], expected: int, name: str) -> None:
    """SGLang expanded the placeholders to OUR prompt length, or the request is refused (the trainer would
    otherwise train on ids the server never saw)."""
    got = meta.get("prompt_tokens")
    if got is not None and int(got) != expected:
        raise ValueError(
            f"{name}: SGLang expanded the media prompt to {got} tokens, the relax processor to {expected}: "
            "the server's processor config differs from the one beside the model"
        )
