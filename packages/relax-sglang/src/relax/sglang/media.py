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
Qwen2.5-VL video per prompt, at ``video_fps``: anything else is refused by name. Qwen3-VL writes each
temporal grid's time into the prompt; its video blocks are collapsed to the template's placeholder and the
times travel in the container (``TIMESTAMPS_TAG``), which Relax's server patch hands to SGLang's processor
(any number of videos per prompt). Other families' videos are refused.

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
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax.core.data_multimodal import model_inputs, source_media
from relax.core.model_family import serving_conventions
from relax.core.multimodal_model import media_flag_keys

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid")
AUDIO_KEYS = ("input_features", "feature_attention_mask")
IGNORED = ("mm_token_type_ids",)  # recomputed by SGLang from the ids
MAX_VIDEO_PIXELS = 16384 * 28 * 28  # per frame: far above any relax-omni budget (frames keep their size)
# how a family's videos reach SGLang (its model adapter's ``ServingConventions.video_layout``): one video per
# prompt with the sampling fps as server-wide metadata, or each temporal grid's time written in the prompt
FPS_VIDEOS, TIMESTAMPED_VIDEOS = "fps", "timestamped"
# container tags read by relax_sglang_server_patches (same names there): ours (keep the frames' size), and times
VIDEO_TAG, TIMESTAMPS_TAG = "RELAX_VIDEO", "RELAX_TIMESTAMPS"
TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


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
    video_mean: tuple[float, float, float] | None = None  # the video processor's, where it has its own
    video_std: tuple[float, float, float] | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None


def load_image_spec(model_dir: str) -> ImageSpec | None:
    """The spec from ``config.json`` + ``processor_config.json`` / ``preprocessor_config.json``; None for a
    model without an image token (text-only)."""
    root = Path(model_dir)
    config = _model_config(root)
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        return None
    proc: dict[str, Any] = {}
    video: dict[str, Any] = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (root / name).exists():
            data = json.loads((root / name).read_text())
            proc, video = data.get("image_processor", data), data.get("video_processor", {})
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
        video_mean=tuple(video["image_mean"]) if "image_mean" in video else None,
        video_std=tuple(video["image_std"]) if "image_std" in video else None,
        vision_start_token_id=config.get("vision_start_token_id"),
        vision_end_token_id=config.get("vision_end_token_id"),
    )


def _model_config(root: Path) -> dict[str, Any]:
    """``config.json``, or the sub-config its family's adapter names as the media model's
    (``ServingConventions.media_config_key``: a checkpoint served whole whose part reads the media)."""
    config = json.loads((root / "config.json").read_text())
    key = serving_conventions(config.get("model_type")).media_config_key
    return config.get(key, config) if key else config


def video_layout(model_type: str | None) -> str:
    """How the family's videos reach SGLang ("" none: its videos are refused)."""
    return serving_conventions(model_type).video_layout


def audio_rate(model_type: str | None) -> int:
    """The sample rate of the waveforms the family's processor keeps (0: the family declares no audio)."""
    return serving_conventions(model_type).audio_sample_rate


def video_model_type(model_dir: str) -> str | None:
    """The model type if the engine sends the model video (its adapter declares a video layout; its server then
    gets ``video_server_args``), else None."""
    root = Path(model_dir)
    kind = _model_config(root).get("model_type") if (root / "config.json").exists() else None
    return kind if video_layout(kind) else None


def video_server_args(video_fps: float, model_type: str | None = None) -> list[str]:
    """``sglang.launch_server`` arguments under which SGLang re-processes our rebuilt video frames exactly:
    sample at ``video_fps`` (the container's rate: every frame kept) and keep each frame's size (in SGLang's
    resize and the HF processor's). Qwen2.5-VL's HF processor also gets ``video_fps`` as the metadata SGLang
    does not pass it (M-RoPE seconds per temporal grid); Qwen3-VL's gets SGLang's own, with our frame times
    (``TIMESTAMPS_TAG``, see ``relax_sglang_server_patches``)."""
    pixels = {"min_pixels": 1, "max_pixels": MAX_VIDEO_PIXELS}
    video = {"fps": video_fps, **pixels, "size": {"shortest_edge": 1, "longest_edge": MAX_VIDEO_PIXELS}}
    if video_layout(model_type) != TIMESTAMPED_VIDEOS:
        video["video_metadata"] = {"fps": video_fps, "total_num_frames": 1}
    return ["--mm-process-config", json.dumps({"video": video})]


def frames_from_patches(
    pixel_values: Any, grid_thw: Any, spec: ImageSpec, what: str = "pixel_values"
) -> list[np.ndarray]:
    """Per item, the (T * temporal_patch_size, H, W, 3) uint8 frames whose Qwen-VL patches are
    ``pixel_values`` (inverse of the HF processor's patchify + normalize); ``what`` names the inputs in errors."""
    x = np.asarray(pixel_values, dtype=np.float64)
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    video = what.endswith("videos")
    mean = np.asarray(spec.video_mean if video and spec.video_mean else spec.image_mean)[:, None, None]
    std = np.asarray(spec.video_std if video and spec.video_std else spec.image_std)[:, None, None]
    grid = "video_grid_thw" if video else "image_grid_thw"
    items, start = [], 0
    for t, gh, gw in grids.tolist():
        n = t * gh * gw
        chunk = x[start : start + n]
        start += n
        if chunk.shape != (n, 3 * tp * p * p):
            raise ValueError(
                f"{what} rows {chunk.shape} do not match {grid} {(t, gh, gw)} and patch "
                f"size {p} x temporal {tp}"
            )
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
        raise ValueError(
            "video and audio requests to SGLang need PyAV (pip install av) to encode them"
        ) from exc
    return av


def video_data_url(frames: np.ndarray, fps: float, timestamps: list[str] | None = None) -> str:
    """``frames`` (T, H, W, 3 uint8) as a lossless FFV1/Matroska data URL at ``fps`` (decoded back to the
    same pixels by SGLang's decord/torchcodec reader), tagged as ours (``VIDEO_TAG``: the server patch keeps
    the frames' size); ``timestamps``: each temporal grid's time as the prompt writes it (``TIMESTAMPS_TAG``)."""
    from fractions import Fraction

    av = _av()
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        out.metadata[VIDEO_TAG] = "1"
        if timestamps is not None:
            out.metadata[TIMESTAMPS_TAG] = ",".join(timestamps)
        stream = out.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return "data:video/x-matroska;base64," + base64.b64encode(buf.getvalue()).decode()


def audio_data_url(waveform: np.ndarray, rate: int) -> str:
    """A mono ``AUDIO_RATE`` waveform as float32 PCM in a Matroska data URL: lossless, and a container that
    SGLang decodes with PyAV (its WAV path needs torchaudio, absent from the CPU server env)."""
    av = _av()
    samples = np.ascontiguousarray(np.asarray(waveform, dtype=np.float32).reshape(1, -1))
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("pcm_f32le", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = rate
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
    inputs: dict[str, Any],
    prompt_ids: list[int],
    spec: ImageSpec | None,
    video_fps: float = 2.0,
    audios: list[np.ndarray] | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> MediaRequest:
    """The HTTP form of one prompt's processed media (see the module docstring); what SGLang cannot take
    exactly is an error naming it. ``video_fps``: the server's video sampling fps (``video_server_args``);
    ``audios``: the prompt's decoded waveforms, in order (its ``input_features`` cannot be inverted); by
    default its ``source.audio.<i>`` entries; ``decode``: the tokenizer's, to read Qwen3-VL frame times."""
    if audios is None:
        audios = source_media(inputs, "audio") or None
    inputs = model_inputs(inputs)
    unsupported = sorted(set(inputs) - set(IMAGE_KEYS) - set(VIDEO_KEYS) - set(AUDIO_KEYS) - set(IGNORED))
    flags = sorted(set(unsupported) & media_flag_keys())  # model adapters' per-prompt forward flags
    if flags:
        raise ValueError(
            f"media inputs {flags[0]}: SGLang 0.5.23 builds M-RoPE positions with {flags[0]}=False "
            "and takes no precomputed positions over HTTP, so these rows would get wrong positions; use the hf "
            "engine for audio-in-video prompts"
        )
    if unsupported:
        raise ValueError(
            f"media inputs {unsupported}: the sglang engine sends images, videos and audio waveforms "
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
    if "pixel_values_videos" in inputs and video_layout(spec.model_type) == TIMESTAMPED_VIDEOS:
        ids, fields["video_data"] = _timestamped_videos(ids, inputs, spec, video_fps, decode)
    elif "pixel_values_videos" in inputs:
        videos = _videos(inputs, spec, video_fps)
        ids = _collapsed(ids, spec.video_token_id, len(videos), "video")
        fields["video_data"] = [video_data_url(frames, video_fps) for frames in videos]
    if "input_features" in inputs:
        if spec.audio_token_id is None:
            raise ValueError("audio inputs for a model without audio_token_id in its config.json")
        rate = audio_rate(spec.model_type)
        if not rate:
            raise ValueError(
                f"audio inputs for model_type {spec.model_type!r}, whose model adapter declares no audio "
                "sample rate (ServingConventions.audio_sample_rate); use the hf engine for them"
            )
        ids = _collapsed(ids, spec.audio_token_id, len(audios), "audio")
        fields["audio_data"] = [audio_data_url(w, rate) for w in audios]
    return MediaRequest(ids, fields)


def _collapsed(ids: list[int], token_id: int, items: int, kind: str) -> list[int]:
    collapsed = collapse_runs(ids, token_id)
    if collapsed.count(token_id) != items:
        raise ValueError(
            f"prompt has {collapsed.count(token_id)} {kind} placeholder runs for {items} {kind}s"
        )
    return collapsed


def _videos(inputs: dict[str, Any], spec: ImageSpec, video_fps: float) -> list[np.ndarray]:
    """The sampled frames of the prompt's one video, after checking SGLang can take it exactly."""
    if video_layout(spec.model_type) != FPS_VIDEOS or spec.video_token_id is None:
        raise ValueError(
            f"video inputs for model_type {spec.model_type!r}: its model adapter declares no video layout SGLang "
            "re-processes exactly (ServingConventions.video_layout); use the hf engine for these videos"
        )
    per_grid = inputs.get("second_per_grid_ts", inputs.get("video_second_per_grid", []))
    seconds = [float(s) for s in np.asarray(per_grid, dtype=np.float64).reshape(-1)]
    if len(seconds) != 1:
        raise ValueError(
            f"{len(seconds)} videos in one prompt: SGLang 0.5.23 gives the {spec.model_type} processor one "
            "server-wide fps (--mm-process-config), which holds one video per prompt; use the hf engine for these prompts"
        )
    expected = spec.temporal_patch_size / video_fps
    if abs(seconds[0] - expected) > 1e-4 * expected:
        raise ValueError(
            f"video sampled at {spec.temporal_patch_size / seconds[0]:g} fps (second_per_grid_ts {seconds[0]:g}), "
            f"the SGLang server samples at engine_params.video_fps={video_fps:g}: M-RoPE times would differ; set "
            "data.processor_params.fps and engine_params.video_fps alike (a short video may get another fps)"
        )
    return frames_from_patches(
        inputs["pixel_values_videos"], inputs["video_grid_thw"], spec, "pixel_values_videos"
    )


def _timestamped_videos(
    ids: list[int],
    inputs: dict[str, Any],
    spec: ImageSpec,
    video_fps: float,
    decode: Callable[[list[int]], str] | None,
) -> tuple[list[int], list[str]]:
    """Qwen3-VL videos: the prompt writes each video as ``<vs> (<t seconds> <vs> pad.. <ve>) per temporal grid
    <ve>``. Each such block becomes the template's single ``<vs> pad <ve>`` again, and its frames go in a
    container tagged with the block's times, which the server patch gives SGLang's processor (SGLang 0.5.23
    would re-derive them from the container with its own frame sampling, and the prompt text would differ).
    Returns the collapsed ids and the video data URLs."""
    pad, start, end = spec.video_token_id, spec.vision_start_token_id, spec.vision_end_token_id
    if decode is None or start is None or end is None:
        raise ValueError(
            "timestamped video requests need the tokenizer and vision_start/end_token_id in config.json"
        )
    videos = frames_from_patches(
        inputs["pixel_values_videos"], inputs["video_grid_thw"], spec, "pixel_values_videos"
    )
    runs, pos = [], 0  # [first, last + 1) of every run of the video placeholder
    for token, run in itertools.groupby(ids):
        n = len(list(run))
        if token == pad:
            runs.append((pos, pos + n))
        pos += n
    grids = [int(t) for t in np.asarray(inputs["video_grid_thw"]).reshape(-1, 3)[:, 0]]
    if len(runs) != sum(grids):
        raise ValueError(
            f"prompt has {len(runs)} video frame runs for {len(grids)} videos of {sum(grids)} temporal grids"
        )
    out, urls, cursor = [], [], 0
    for frames, group in zip(videos, np.split(np.asarray(runs), np.cumsum(grids)[:-1]), strict=True):
        opening = max((k for k in range(cursor, group[0][0] - 1) if ids[k] == start), default=None)
        stamps, prev = [], (opening or 0) + 1
        for first, last in group.tolist():
            text = decode(ids[prev : first - 1]).strip()
            if (
                opening is None
                or ids[first - 1] != start
                or last >= len(ids)
                or ids[last] != end
                or not TIMESTAMP.fullmatch(text)
            ):
                raise ValueError(
                    f"video block at prompt position {first} is not <t seconds><vision_start>pads<vision_end> "
                    f"(read {text!r}): not a timestamped-video prompt"
                )
            stamps.append(TIMESTAMP.fullmatch(text).group(1))
            prev = last + 1
        if prev >= len(ids) or ids[prev] != end:
            raise ValueError(f"video block ending at prompt position {prev} lacks its closing vision_end")
        out += ids[cursor : opening + 1] + [pad]
        cursor = prev
        urls.append(video_data_url(frames, video_fps, stamps))
    return out + ids[cursor:], urls


def check_prompt_tokens(meta: dict[str, Any], expected: int, name: str) -> None:
    """SGLang expanded the placeholders to OUR prompt length, or the request is refused (the trainer would
    otherwise train on ids the server never saw)."""
    got = meta.get("prompt_tokens")
    if got is not None and int(got) != expected:
        raise ValueError(
            f"{name}: SGLang expanded the media prompt to {got} tokens, the relax processor to {expected}: "
            "the server's processor config differs from the one beside the model"
        )
