"""A minimal ``MultimodalProcessor`` over the HF ``AutoProcessor`` for core's tests (relax-omni has the real one).

Media refs are local paths or ``file://`` URLs: images (PIL), videos as ``.npy`` frame arrays (T, H, W, 3),
audio as ``.npy`` 16 kHz float waveforms. Bad media raise ``MediaError`` naming the row and item.
``calls`` counts ``process`` calls, so tests can assert a group's media are processed once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from relax.core.processors import MediaError, ProcessedPrompt

KINDS = ("image", "video", "audio")
#: small media budgets keep tiny-model forwards in milliseconds
CALL_KWARGS = {
    "images_kwargs": {"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}},
    "videos_kwargs": {"size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}, "do_sample_frames": False},
    "audio_kwargs": {"padding": "longest"},
}


def _path(ref: Any) -> Path:
    text = str(ref)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def load_media(kind: str, ref: Any) -> Any:
    """Load one media item; raises ``ValueError`` with the reason (the caller names row and item)."""
    if kind == "image" and hasattr(ref, "convert"):  # a PIL image (a tool's output), not a file
        return ref.convert("RGB")
    path = _path(ref)
    if not path.exists():
        raise ValueError(f"no such file {str(path)!r}")
    if kind == "image":
        from PIL import Image

        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except Exception as e:  # PIL raises several types for bad bytes
            raise ValueError(f"undecodable image ({e})") from e
    try:
        array = np.load(path, allow_pickle=False)
    except Exception as e:
        raise ValueError(f"undecodable {kind} ({e})") from e
    want = 4 if kind == "video" else 1
    if array.ndim != want:
        raise ValueError(f"{kind} array must have {want} dims, got shape {array.shape}")
    return array.astype(np.uint8 if kind == "video" else np.float32)


class TinyMediaProcessor:
    """``MultimodalProcessor`` for the tiny families of ``relax.omni.tiny_models``."""

    multimodal = True

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        self.calls = 0

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.process(messages, [], "<direct call>")
        return {"prompt_text": out["prompt_text"], "prompt_ids": out["prompt_ids"]}

    def process(
        self, messages: list[dict[str, Any]], media: list[dict[str, Any]], where: str
    ) -> ProcessedPrompt:
        self.calls += 1
        messages = [dict(m) for m in messages]
        if media:  # column media join the first user message
            first = next(m for m in messages if m["role"] == "user")
            content = first["content"]
            items = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
            first["content"] = [{"type": _kind_of(r, where), "image": r["ref"]} for r in media] + items
            for item in first["content"]:
                if item["type"] in ("video", "audio"):
                    item[item["type"]] = item.pop("image")
        loaded = _load_all(messages, where)
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._run(text, loaded)

    def continue_with(
        self, messages: list[dict[str, Any]], ended_with: str | None, where: str
    ) -> ProcessedPrompt:
        """Observation messages with media (``SupportsObservationMedia``), rendered as a continuation."""
        from relax.core.agentic import ObservationRenderer

        loaded = _load_all(messages, where)
        return self._run(ObservationRenderer(self.hf).text(messages, ended_with), loaded)

    def _run(self, text: str, loaded: dict[str, list[Any]]) -> ProcessedPrompt:
        kwargs = {f"{k}s" if k != "audio" else "audio": v for k, v in loaded.items() if v}
        out = self.hf(text=[text], return_tensors="pt", **kwargs, **CALL_KWARGS)
        inputs = {
            k: v[0] if k == "mm_token_type_ids" else v
            for k, v in out.items()
            if k not in ("input_ids", "attention_mask") and hasattr(v, "shape")
        }
        ids = out["input_ids"][0].tolist()
        return ProcessedPrompt(
            prompt_text=text,
            prompt_ids=ids,
            inputs=inputs,
            counts={k: len(v) for k, v in loaded.items() if v},
        )


def _load_all(messages: list[dict[str, Any]], where: str) -> dict[str, list[Any]]:
    """Every media item of ``messages``, by kind, in order."""
    loaded: dict[str, list[Any]] = {k: [] for k in KINDS}
    for i, m in enumerate(messages):
        if isinstance(m["content"], str):
            continue
        for j, item in enumerate(m["content"]):
            kind = item.get("type")
            if kind in KINDS:
                try:
                    loaded[kind].append(load_media(kind, item.get(kind)))
                except ValueError as e:
                    raise MediaError(
                        where, f"messages[{i}].content[{j}] {kind} {item.get(kind)!r}", str(e)
                    ) from e
            elif kind != "text":
                raise MediaError(where, f"messages[{i}].content[{j}]", f"unknown content type {kind!r}")
    return loaded


def _kind_of(ref: dict[str, Any], where: str) -> str:
    suffix = _path(ref["ref"]).suffix
    if suffix == ".npy":
        return "video" if "video" in ref["key"] else "audio"
    if suffix in (".png", ".jpg", ".jpeg"):
        return "image"
    raise MediaError(where, f"column {ref['key']!r} {ref['ref']!r}", f"unknown media type {suffix!r}")
