"""Multimodal prompts between the dataset, the engines and the trainer (backend-neutral).

A multimodal processor runs once per prompt when the prompt is drawn (``process_drawn``); its model
inputs (pixel values, grids, audio features) are stored once (``share``: the Ray object store when Ray
runs) and every sample / request of the group holds the same reference. ``collate`` packs each row's
inputs into padded per-row tensors (``pack_media``), so row slicing -- micro-batches, mini-batches,
data-parallel shards -- keeps each row's media with it; ``unpack_media`` restores the exact tensors
the processor returned, concatenated in row order as HF models expect.

Entries named ``source.<kind>.<i>`` (``SOURCE``) are not model inputs: the original media that an engine
re-processing them needs (relax-omni keeps each prompt's decoded 16 kHz audio waveforms as
``source.audio.0``, ... for the sglang engine, since audio features cannot be inverted). Whatever feeds a
model drops them (``model_inputs``), and ``collate`` never ships them into training batches.

A processor may also store per-prompt flags for the model's forward beside the media tensors; the model's
adapter declares their keys (``ModelAdapter.media_flags``, all of them: ``multimodal_model.media_flag_keys``),
so an engine that cannot honour one refuses the prompt naming it without knowing the plugin that set it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.core.processors import MediaError

log = logging.getLogger(__name__)
PREFIX = "mm."  # batch keys: "mm.<key>" (B, N, ...) zero-padded, "mm.<key>.shape" (B, ndim) true shapes
TOKEN_LEVEL = ("mm_token_type_ids",)  # per-token processor outputs: recomputed from the ids, not carried
SOURCE = "source."  # processed-input keys "source.<kind>.<i>": original media for engines, never model inputs


def model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` without the ``SOURCE`` entries: what a model's forward takes."""
    return {k: v for k, v in inputs.items() if not k.startswith(SOURCE)}


def source_media(inputs: dict[str, Any], kind: str) -> list[Any]:
    """The ``source.<kind>.<i>`` entries of ``inputs`` in item order (empty when the processor kept none)."""
    head = f"{SOURCE}{kind}."
    found = {
        int(k[len(head) :]): v for k, v in inputs.items() if k.startswith(head) and k[len(head) :].isdigit()
    }
    return [found[i] for i in sorted(found)]


def share(inputs: dict[str, torch.Tensor]) -> Any:
    """One stored copy of a prompt's inputs: an object-store reference when Ray runs, else the dict."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.put(inputs)
    return inputs


def merge_media(
    first: dict[str, torch.Tensor] | None, then: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One prompt's inputs followed by more media of the same sequence (a tool's image in a multi-turn
    episode): each tensor concatenated along its item axis, so placeholders and inputs keep one order.
    Per-token entries are dropped (recomputed from the ids); original media (``source.*``) cannot follow."""
    if any(k.startswith(SOURCE) for k in then):
        raise ValueError(
            f"media after the prompt cannot carry original media entries ({SOURCE}*): images only"
        )
    merged = {k: v for k, v in (first or {}).items() if k not in TOKEN_LEVEL}
    for key, value in then.items():
        if key not in TOKEN_LEVEL:
            merged[key] = torch.cat([merged[key], value]) if key in merged else value
    return merged


def resolve(ref: Any) -> dict[str, torch.Tensor]:
    """The inputs behind a reference from ``share`` (fetched once per distinct reference by callers)."""
    if ref is None or isinstance(ref, dict):
        return ref
    import ray

    return ray.get(ref)


def resolve_all(refs: Sequence[Any]) -> list[dict[str, torch.Tensor] | None]:
    """``resolve`` for a list, fetching each distinct reference once (a group shares one)."""
    seen: dict[Any, Any] = {}
    out = []
    for ref in refs:
        key = ref.hex() if hasattr(ref, "hex") and not isinstance(ref, dict) else id(ref)  # ObjectRef: by id
        if key not in seen:
            seen[key] = resolve(ref)
        out.append(seen[key])
    return out


def pack_media(rows: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Per-row media as padded tensors: ``mm.<key>`` (B, *max shape) and ``mm.<key>.shape`` (B, ndim); the
    ``SOURCE`` entries stay out (no trainer memory for media no model reads)."""
    keys = sorted({k for r in rows if r for k in r if k not in TOKEN_LEVEL and not k.startswith(SOURCE)})
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        tensors = [None if r is None else r.get(key) for r in rows]
        ref = next(t for t in tensors if t is not None)
        ndim = ref.dim()
        shapes = torch.zeros((len(rows), ndim), dtype=torch.long)
        for i, t in enumerate(tensors):
            if t is not None:
                if t.dim() != ndim:
                    raise ValueError(f"media input {key!r}: rows disagree on rank ({t.dim()} vs {ndim})")
                shapes[i] = torch.tensor(t.shape)
        padded = torch.zeros((len(rows), *shapes.max(0).values.tolist()), dtype=ref.dtype)
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                padded[(i, *(slice(0, n) for n in t.shape))] = t
        out[PREFIX + key], out[PREFIX + key + ".shape"] = padded, shapes
    return out


def has_media(batch: dict[str, Any]) -> bool:
    return any(k.startswith(PREFIX) for k in batch)


def row_media(batch: dict[str, Any], row: int) -> dict[str, torch.Tensor]:
    """Row ``row``'s media exactly as the processor returned them (keys it had)."""
    out = {}
    for key in batch:
        if key.startswith(PREFIX) and not key.endswith(".shape"):
            shape = batch[key + ".shape"][row].tolist()
            if shape and shape[0] > 0:
                out[key[len(PREFIX) :]] = batch[key][(row, *(slice(0, n) for n in shape))]
    return out


def unpack_media(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's media kwargs for all rows of ``batch``: each key's rows concatenated in row order
    (trailing dims zero-padded to the widest row, e.g. audio frames, which the feature mask covers)."""
    rows = batch["input_ids"].shape[0]
    per_key: dict[str, list[torch.Tensor]] = {}
    for i in range(rows):
        for key, t in row_media(batch, i).items():
            per_key.setdefault(key, []).append(t)
    out = {}
    for key, parts in per_key.items():
        widest = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        if any(list(p.shape[1:]) != widest for p in parts):
            parts = [torch.nn.functional.pad(p, _pad_spec(p.shape[1:], widest)) for p in parts]
        out[key] = torch.cat(parts)
    return out


def _pad_spec(shape: Sequence[int], target: Sequence[int]) -> list[int]:
    spec: list[int] = []
    for have, want in reversed(list(zip(shape, target, strict=True))):
        spec += [0, want - have]
    return spec


#: dataset counters that grow while prompts are drawn (logged with every step, not only at load)
DRAW_STATS = (
    "processed_prompts",
    "skipped_media",
    "filtered_too_long",
    "media_image",
    "media_video",
    "media_audio",
)


def process_drawn(
    items: list[Any],
    processor: Any,
    on_error: str,
    draw_one: Callable[[], Any],
    stats: dict[str, int],
    max_prompt_length: int | None = None,
) -> list[tuple[Any, dict[str, Any]]]:
    """Run ``processor.process`` once per drawn prompt item; returns ``(item, processed)`` pairs.

    A ``MediaError`` raises (``on_error: raise``), or is counted in ``stats["skipped_media"]`` and the
    prompt replaced by the next one from ``draw_one`` (``skip``): the other prompts are kept as they are.
    A prompt longer than ``max_prompt_length`` once its media placeholders are expanded is dropped and
    counted (``filtered_too_long``, as core does for text rows at load) and replaced, never truncated.
    """
    out = []
    queue = list(items)
    budget = 100 * max(1, len(items))  # every row bad: fail instead of drawing forever

    def reject(item: Any, counter: str, what: str, detail: str, error: Exception | None = None) -> None:
        nonlocal budget
        stats[counter] = stats.get(counter, 0) + 1
        if stats[counter] <= 5:  # later ones are only counted
            log.warning(
                "data: dropped prompt %s, %s (further ones only counted after 5): %s", item.uid, what, detail
            )
        budget -= 1
        if budget <= 0:
            raise MediaError(item.uid, "every drawn prompt", f"{what} in too many rows in a row") from error
        queue.append(draw_one())

    while queue:
        item = queue.pop(0)
        try:
            processed = processor.process(list(item.messages), list(item.media), item.uid)
        except MediaError as e:
            if on_error != "skip":
                raise
            reject(item, "skipped_media", "bad media", str(e), e)
            continue
        n = len(processed["prompt_ids"])
        if max_prompt_length and n > max_prompt_length:
            reject(
                item,
                "filtered_too_long",
                f"prompts longer than data.max_prompt_length={max_prompt_length}",
                f"{n} prompt tokens with media expanded",
            )
            continue
        stats["processed_prompts"] = stats.get("processed_prompts", 0) + 1
        for kind, count in processed.get("counts", {}).items():
            stats[f"media_{kind}"] = stats.get(f"media_{kind}", 0) + int(count)
        out.append((item, processed))
    return out


def draw_counts(dataset: Any) -> dict[str, float]:
    """``data/<counter>`` so far for the draw-time counters of a multimodal dataset (empty for text)."""
    if not getattr(dataset, "multimodal", False):
        return {}
    stats = dict(dataset.stats)  # the async producer may be drawing
    return {f"data/{k}": float(stats.get(k, 0)) for k in DRAW_STATS}


def draw_multimodal(dataset: Any, items: list[Any]) -> tuple[list[Any], list[Any]]:
    """Drawn prompt items with their processed text and ids, and one shared inputs reference per item."""
    from dataclasses import replace

    cfg = dataset.config
    pairs = process_drawn(
        items, dataset.processor, cfg.on_error, dataset.next_item, dataset.stats, cfg.max_prompt_length
    )
    ready = [replace(it, prompt_ids=list(p["prompt_ids"]), prompt_text=p["prompt_text"]) for it, p in pairs]
    return ready, [share(p["inputs"]) for _, p in pairs]
