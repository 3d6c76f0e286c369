"""Media loading for one prompt: references -> decoded, budgeted media through qwen-omni-utils.

A reference is a local path, a ``file://`` URL or a base64 ``data:`` URL. Each item is loaded on its own
(qwen-omni-utils' ``fetch_image`` / ``fetch_video`` / ``process_audio_info``, the pieces its
``process_mm_info`` composes) so that any failure -- missing file, truncated image, undecodable audio or
video, wrong type, over budget -- becomes a ``MediaError`` naming the dataset row and the item, never a
bare decoder traceback. Remote URLs are refused: runs read no network.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.core.processors import MediaError

KINDS = ("image", "video", "audio")
SAMPLE_RATE = 16000  # qwen-omni-utils resamples every audio track to 16 kHz (Whisper features)


@dataclass(frozen=True)
class MediaBudget:
    """Per-item budgets handed to qwen-omni-utils (pixels are per image / per video frame)."""

    min_pixels: int = 4 * 28 * 28  # images are resized into [min_pixels, max_pixels], aspect kept
    max_pixels: int = 1024 * 28 * 28
    video_min_pixels: int = 128 * 28 * 28  # per sampled frame
    video_max_pixels: int = 768 * 28 * 28
    fps: float = 2.0  # frames sampled per second of video
    max_frames: int = 64  # at most this many frames per video (even: Qwen pairs frames)
    max_audio_seconds: float = 300.0  # a longer audio item (or video soundtrack) is over budget
    use_audio_in_video: bool = False  # Omni: also feed a video's soundtrack (needs the ffmpeg binary)
    max_bytes_per_item: int = 64 << 20  # a larger file / data URL is over budget, before decoding
    media_root: str | None = None  # relative paths resolve against this directory (default: working dir)

    def validate(self) -> list[str]:
        errors = []
        for name in (
            "min_pixels",
            "max_pixels",
            "video_min_pixels",
            "video_max_pixels",
            "max_bytes_per_item",
        ):
            if getattr(self, name) <= 0:
                errors.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            errors.append(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if self.video_min_pixels > self.video_max_pixels:
            errors.append(
                f"video_min_pixels ({self.video_min_pixels}) must be <= video_max_pixels ({self.video_max_pixels})"
            )
        if self.fps <= 0:
            errors.append(f"fps must be > 0, got {self.fps}")
        if self.max_frames < 2:
            errors.append(f"max_frames must be >= 2 (Qwen groups frames in pairs), got {self.max_frames}")
        if self.max_audio_seconds <= 0:
            errors.append(f"max_audio_seconds must be > 0, got {self.max_audio_seconds}")
        return errors


@dataclass
class LoadedMedia:
    """One prompt's decoded media, in message order per kind (the order the HF processor pairs them with
    placeholders), plus the conversation with column media attached."""

    messages: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    video_metadata: list[dict[str, Any]] = field(default_factory=list)  # native fps, sampled frame indices
    video_fps: list[float] = field(default_factory=list)  # frames sampled per second, per video
    audios: list[Any] = field(default_factory=list)
    # per entry of ``audios``: None for an audio item, i for the soundtrack of ``videos[i]`` (use_audio_in_video)
    audio_from_video: list[int | None] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return {"image": len(self.images), "video": len(self.videos), "audio": len(self.audios)}


def _qwen_utils():
    """qwen-omni-utils, with decord as its video reader (torchvision 0.28's reader is the fallback)."""
    os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")  # read when the module is imported
    from qwen_omni_utils.v2_5 import audio_process, vision_process

    quiet = logging.getLogger(
        "qwen_omni_utils"
    )  # an INFO line per decoded video: unless asked for, only warnings
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.WARNING)

    return vision_process, audio_process


def short_ref(ref: Any) -> str:
    """The reference as errors show it: a long path keeps its file name, a data URL its type."""
    text = str(ref)
    if len(text) <= 48:
        return repr(text)
    return repr(text[:45] + "..." if text.startswith("data:") else "..." + text[-45:])


def kind_of_column(key: str, ref: Any) -> str | None:
    """The media kind of a column reference: the dict's ``type`` / kind key, else the column's name."""
    if isinstance(ref, dict):
        if ref.get("type") in KINDS:
            return ref["type"]
        return next((k for k in KINDS if k in ref), None)
    return next((k for k in KINDS if k in key.lower()), None)


def attach_columns(messages: list[dict[str, Any]], media: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of ``messages`` with column media (``{"key", "ref"}``) put before the first user message's
    text, each tagged ``_item`` with its name for errors."""
    out = [dict(m) for m in messages]
    if not media:
        return out
    user = next((m for m in out if m.get("role") == "user"), None)
    if user is None:
        raise MediaError("?", "media", "the row has media columns but no user message to attach them to")
    content = user["content"]
    items = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    extra = []
    for i, m in enumerate(media):
        ref = m["ref"]
        kind, name = kind_of_column(m["key"], ref), f"media[{i}] (column {m['key']!r})"
        if kind is None:
            raise MediaError(
                "?",
                name,
                f"cannot tell the media kind of column {m['key']!r} (name the column "
                'image/video/audio, or give {"type": ..., <type>: ref} dicts)',
            )
        value = ref.get(kind) if isinstance(ref, dict) else ref
        extra.append({"type": kind, kind: value, "_item": name})
    user["content"] = extra + items
    return out


def load_media(
    messages: list[dict[str, Any]],
    media: list[dict[str, Any]],
    budget: MediaBudget,
    where: str,
    patch_size: int = 14,
    allowed: tuple[str, ...] = KINDS,
) -> LoadedMedia:
    """Decode every media item of one prompt within ``budget``; raise ``MediaError(where, item, why)``."""
    try:
        messages = attach_columns(messages, media)
    except MediaError as e:
        raise MediaError(where, e.item, e.why) from None
    loaded = LoadedMedia(messages=[])
    for mi, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            loaded.messages.append(message)
            continue
        clean = []
        for ci, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                clean.append(item)
                continue
            name = (
                item.get("_item", f"messages[{mi}].content[{ci}]")
                if isinstance(item, dict)
                else (f"messages[{mi}].content[{ci}]")
            )
            if kind not in KINDS:
                raise MediaError(
                    where, name, f"unsupported content type {kind!r} (expected text, image, video or audio)"
                )
            label = f"{name} {kind} {short_ref(item.get(kind))}"
            if kind not in allowed:
                raise MediaError(
                    where, label, f"wrong type: this model takes {', '.join(allowed)}, not {kind}"
                )
            _load_item(
                loaded,
                kind,
                item.get(kind),
                budget,
                patch_size,
                lambda why, lb=label: MediaError(where, lb, why),
            )
            clean.append({"type": kind})  # the chat template only needs the placeholder
        loaded.messages.append({**message, "content": clean})
    return loaded


def _load_item(loaded: LoadedMedia, kind: str, ref: Any, budget: MediaBudget, patch_size: int, err) -> None:
    source = _open_ref(kind, ref, budget, err)  # a local Path or the decoded bytes of a data URL
    vision, audio = _qwen_utils()
    if kind == "image":
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(source if isinstance(source, Path) else io.BytesIO(source))
            image.load()
            ele = {"image": image, "min_pixels": budget.min_pixels, "max_pixels": budget.max_pixels}
            loaded.images.append(vision.fetch_image(ele, image_patch_size=patch_size))
        except UnidentifiedImageError:
            raise err("not a decodable image") from None
        except OSError as e:
            raise err("truncated image" if "truncated" in str(e) else f"undecodable image ({e})") from None
    elif kind == "audio":
        track = _decode_audio(audio, {"type": "audio", "audio": _audio_input(source)}, False, err, "audio")
        _check_seconds(track, budget, err, "audio")
        loaded.audios.append(track)
        loaded.audio_from_video.append(None)
    else:
        tmp = None if isinstance(source, Path) else _spill(source)
        path = source if tmp is None else tmp
        try:
            ele = {
                "video": str(path),
                "fps": budget.fps,
                "max_frames": budget.max_frames,
                "min_pixels": budget.video_min_pixels,
                "max_pixels": budget.video_max_pixels,
            }
            try:
                (frames, meta), sample_fps = vision.fetch_video(
                    ele, image_patch_size=patch_size, return_video_metadata=True, return_video_sample_fps=True
                )
            except Exception as e:  # decord / torchvision raise assorted errors (kept as __cause__)
                raise err("undecodable video") from e
            loaded.videos.append(frames)
            loaded.video_metadata.append(meta)
            loaded.video_fps.append(float(sample_fps))
            if budget.use_audio_in_video:
                track = _decode_audio(
                    audio, {"type": "video", "video": str(path)}, True, err, "video soundtrack"
                )
                _check_seconds(track, budget, err, "video soundtrack")
                loaded.audios.append(track)
                loaded.audio_from_video.append(len(loaded.videos) - 1)
        finally:
            if tmp is not None:
                os.unlink(tmp)


def _open_ref(kind: str, ref: Any, budget: MediaBudget, err) -> Path | bytes:
    if not isinstance(ref, str) or not ref:
        raise err(
            f"wrong type: expected a path, file:// URL or base64 data URL string, got {type(ref).__name__}"
        )
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        mime = head[5:].split(";")[0]
        if not sep or not head.endswith(";base64"):
            raise err("a data URL must be base64 (data:<type>/<subtype>;base64,...)")
        if mime and mime.split("/")[0] != kind:
            raise err(f"wrong type: a data URL of type {mime} where {kind} is expected")
        if len(payload) * 3 // 4 > budget.max_bytes_per_item:
            raise err(
                f"over budget: about {len(payload) * 3 // 4} bytes > max_bytes_per_item={budget.max_bytes_per_item}"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise err("invalid base64 in data URL") from None
    if ref.startswith(("http://", "https://")):
        raise err("remote URLs are not loaded (runs read no network); download the file and use its path")
    path = Path(ref[len("file://") :] if ref.startswith("file://") else ref)
    if not path.is_absolute() and budget.media_root is not None:
        path = Path(budget.media_root) / path
    if not path.is_file():
        raise err(f"file not found: {path}")
    size = path.stat().st_size
    if size > budget.max_bytes_per_item:
        raise err(f"over budget: {size} bytes > max_bytes_per_item={budget.max_bytes_per_item}")
    return path


def _audio_input(source: Path | bytes) -> str:
    if isinstance(source, Path):
        return str(source)
    return "data:audio;base64," + base64.b64encode(source).decode()  # the form qwen-omni-utils decodes


def _decode_audio(audio, ele: dict[str, Any], in_video: bool, err, what: str):
    if in_video:
        import shutil

        if shutil.which("ffmpeg") is None:
            raise err("use_audio_in_video needs the ffmpeg binary on PATH (scripts/install.sh installs it)")
        import av

        try:
            with av.open(ele["video"]) as container:
                has_audio = any(s.type == "audio" for s in container.streams)
        except Exception as e:
            raise err("undecodable video") from e
        if not has_audio:
            raise err("the video has no audio track (use_audio_in_video is on)")
    try:
        (track,) = audio.process_audio_info([{"role": "user", "content": [ele]}], in_video)
    except Exception as e:  # soundfile / audioread / librosa raise assorted errors
        raise err(f"undecodable {what}") from e
    if track.size == 0:
        raise err(f"undecodable {what} (no samples)")
    return track


def _check_seconds(track, budget: MediaBudget, err, what: str) -> None:
    seconds = track.shape[-1] / SAMPLE_RATE
    if seconds > budget.max_audio_seconds:
        raise err(f"over budget: {seconds:.1f} s of {what} > max_audio_seconds={budget.max_audio_seconds}")


def _spill(data: bytes) -> Path:
    """Video decoders want a file: a data URL's bytes go to a temporary one, removed after decoding."""
    fd, name = tempfile.mkstemp(suffix=".media")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(name)
