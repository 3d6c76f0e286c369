"""Media requests for SGLang over HTTP: images rebuilt from the processed ``pixel_values``, placeholders collapsed.

SGLang 0.5.23's ``/generate`` rejects processed tensors over HTTP (its ``image_data`` schema has no
``format``/``processor_output`` field: "unknown field `format`"), so a request carries raw media that
SGLang's own (HF) processor re-processes. relax-omni already resized each image to its patch grid, so its
``pixel_values`` are exactly ``(uint8 / 255 - mean) / std`` of that image: inverting them gives the image
back losslessly (PNG), SGLang's processor then yields the same patches and expands each collapsed
placeholder to the same run of tokens. The engine checks that SGLang's prompt length equals ours
(``check_prompt_tokens``), since the trainer trains on OUR ids.

Video and audio are refused with a clear error: their frames/features cannot be rebuilt exactly, and
audio-in-video rows would get wrong M-RoPE positions (SGLang 0.5.23 builds the index with
``use_audio_in_video=False`` and takes no precomputed positions over HTTP).
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax.core.multimodal_model import AUDIO_IN_VIDEO

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
IGNORED = ("mm_token_type_ids",)  # recomputed by SGLang from the ids


@dataclass(frozen=True)
class ImageSpec:
    """How the model's image processor cut images into patches (from the model directory)."""

    image_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]


def load_image_spec(model_dir: str) -> ImageSpec | None:
    """The spec from ``config.json`` + ``processor_config.json`` / ``preprocessor_config.json``; None for a
    model without an image token (text-only)."""
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
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
    )


def images_from_patches(pixel_values: Any, grid_thw: Any, spec: ImageSpec) -> list[np.ndarray]:
    """The (H, W, 3) uint8 images whose Qwen-VL patches are ``pixel_values`` (inverse of the HF image
    processor's patchify + normalize; the first temporal copy of each image)."""
    x = np.asarray(pixel_values, dtype=np.float64)
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    mean, std = np.asarray(spec.image_mean)[:, None, None], np.asarray(spec.image_std)[:, None, None]
    images, start = [], 0
    for t, gh, gw in grids.tolist():
        n = t * gh * gw
        chunk = x[start:start + n]
        start += n
        if chunk.shape != (n, 3 * tp * p * p):
            raise ValueError(f"pixel_values rows {chunk.shape} do not match image_grid_thw {(t, gh, gw)} and patch "
                             f"size {p} x temporal {tp}")  # fmt: skip
        chunk = chunk.reshape(t, gh // m, gw // m, m, m, 3, tp, p, p).transpose(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frame = chunk.reshape(t * tp, 3, gh * p, gw * p)[0]
        pixels = np.clip(np.rint((frame * std + mean) * 255.0), 0, 255).astype(np.uint8)
        images.append(pixels.transpose(1, 2, 0))
    if start != len(x):
        raise ValueError(f"pixel_values has {len(x)} rows, image_grid_thw accounts for {start}")
    return images


def png_data_url(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


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


def media_request(inputs: dict[str, Any], prompt_ids: list[int], spec: ImageSpec | None) -> MediaRequest:
    """The HTTP form of one prompt's processed media (see the module docstring); anything but images is an
    error naming what SGLang cannot take."""
    unsupported = sorted(set(inputs) - set(IMAGE_KEYS) - set(IGNORED))
    if AUDIO_IN_VIDEO in unsupported:
        raise ValueError(
            "media inputs use_audio_in_video: SGLang 0.5.23 builds M-RoPE positions with use_audio_in_video=False "
            "and takes no precomputed positions over HTTP, so these rows would get wrong positions; use the hf "
            "engine for audio-in-video prompts"
        )
    if unsupported:
        raise ValueError(
            f"media inputs {unsupported}: the sglang engine sends images only (SGLang 0.5.23 takes no processed "
            "tensors over HTTP and video/audio cannot be rebuilt exactly from them); use the hf engine for them"
        )
    if spec is None:
        raise ValueError("media inputs for a model without image_token_id in its config.json")
    images = images_from_patches(inputs["pixel_values"], inputs["image_grid_thw"], spec)
    collapsed = collapse_runs(list(prompt_ids), spec.image_token_id)
    if collapsed.count(spec.image_token_id) != len(images):
        raise ValueError(f"prompt has {collapsed.count(spec.image_token_id)} image placeholder runs for "
                         f"{len(images)} images")  # fmt: skip
    return MediaRequest(collapsed, {"image_data": [png_data_url(im) for im in images]})


def check_prompt_tokens(meta: dict[str, Any], expected: int, name: str) -> None:
    """SGLang expanded the placeholders to OUR prompt length, or the request is refused (the trainer would
    otherwise train on ids the server never saw)."""
    got = meta.get("prompt_tokens")
    if got is not None and int(got) != expected:
        raise ValueError(
            f"{name}: SGLang expanded the media prompt to {got} tokens, the relax processor to {expected}: "
            "the server's processor config differs from the one beside the model"
        )
