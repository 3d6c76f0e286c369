"""Row surgery on a left-padded HF ``DynamicCache``: what continuous batching needs from a KV cache.

A batch of rows decodes over one cache of width ``W``; row ``i`` holds its ``lengths[i]`` real
positions in the *last* columns (left padding, masked out by :func:`attention_mask`). Rows that
finish are dropped (:func:`select_rows`), new rows join (:func:`concat_rows`, the narrower side
padded on the left), and columns no live row uses any more are cut (:func:`trim_left`). Keys are
stored already rotated by each row's own position ids, so moving columns changes no result.

A prompt's cache can also be cut out as one row (:func:`row_layers`), kept, and stacked with
others into the cache of new rows (:func:`stack_rows`): a group's samples reuse one prefill.
A kept sequence's cache can be extended by a new suffix (:func:`suffix_inputs`, then
:func:`row_layers_after_gap`): a multi-turn request prefills only what follows its cached prefix.

Only plain full-attention layers (``DynamicLayer``) can be moved this way: the engine asks
:func:`movable` once and decodes any other model with static batches (``engines.static``);
a cache that still turns out otherwise is refused with an error naming the layer type.
"""

from __future__ import annotations

from typing import Any

import torch


def movable(config: Any) -> bool:
    """Whether the cache transformers builds for ``config`` has only full-attention ``DynamicLayer``s
    (a sliding-window or linear-attention layer keeps state that row surgery would corrupt)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config transformers builds no cache from: its first prefill is checked instead
        return True
    return all(type(layer) is DynamicLayer for layer in layers)


def left_padded(
    contexts: list[list[int]] | list[tuple[int, ...]], pad_token_id: int
) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, position ids) of ``contexts`` left-padded to the longest, on CPU:
    positions count from 0 at each row's first real token, so padding changes no logit."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def check_layers(cache: Any) -> None:
    """Raise if ``cache`` has a layer whose columns cannot be moved freely."""
    from transformers.cache_utils import DynamicLayer

    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        raise NotImplementedError(
            f"HF engine: continuous batching needs full-attention DynamicLayer caches; this model uses {odd}"
        )


def width(cache: Any | None) -> int:
    return 0 if cache is None else cache.layers[0].keys.shape[-2]


def attention_mask(lengths: torch.Tensor, cache_width: int) -> torch.Tensor:
    """(B, W + 1) mask for one decode step: each row's last ``lengths`` columns and the new token."""
    columns = torch.arange(cache_width + 1, device=lengths.device)
    return (columns[None, :] >= (cache_width - lengths)[:, None]).long()


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only ``rows`` (in that order, repeats allowed: a shared prompt becomes G rows)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def trim_left(cache: Any, keep: int) -> None:
    """Drop leading columns so that ``keep`` remain (callers pass the longest live row)."""
    if keep < width(cache):
        for layer in cache.layers:
            layer.keys = layer.keys[..., layer.keys.shape[-2] - keep :, :]
            layer.values = layer.values[..., layer.values.shape[-2] - keep :, :]


def _pad_left(t: torch.Tensor, to: int) -> torch.Tensor:
    if t.shape[-2] == to:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], to - t.shape[-2], t.shape[-1]), t], dim=-2)


def concat_rows(top: Any | None, n_top: int, bottom: Any | None, n_bottom: int) -> Any | None:
    """Stack two row sets into ``top`` (or ``bottom`` when ``top`` is None). A side given as None
    has rows with no cached positions yet (zero width); it becomes zero, fully masked columns."""
    if top is None and bottom is None:
        return None
    like = top if top is not None else bottom
    target = max(width(top), width(bottom))
    for i, layer in enumerate(like.layers):
        for attr in ("keys", "values"):
            ref = getattr(layer, attr)
            parts = []
            for side, n in ((top, n_top), (bottom, n_bottom)):
                if side is None:
                    parts.append(ref.new_zeros(n, ref.shape[1], target, ref.shape[-1]))
                else:
                    parts.append(_pad_left(getattr(side.layers[i], attr), target))
            setattr(layer, attr, torch.cat(parts, dim=0))
    return like


Layers = list[tuple[torch.Tensor, torch.Tensor]]  # one row's (keys, values) per layer, (1, H, T, D)


def row_layers(cache: Any, row: int, length: int) -> Layers:
    """Row ``row``'s last ``length`` positions (its real tokens), per layer."""
    start = width(cache) - length
    rows = slice(row, row + 1)
    return [(layer.keys[rows, :, start:], layer.values[rows, :, start:]) for layer in cache.layers]


def stack_rows(rows: list[Layers]) -> Any:
    """A ``DynamicCache`` whose row i is ``rows[i]``, left-padded to the longest."""
    from transformers import DynamicCache

    target = max(keys.shape[-2] for keys, _ in (r[0] for r in rows))
    return DynamicCache(
        ddp_cache_data=[
            tuple(torch.cat([_pad_left(r[j][kv], target) for r in rows]) for kv in (0, 1))
            for j in range(len(rows[0]))
        ]
    )


def suffix_inputs(
    cached_lengths: list[int], suffixes: list[tuple[int, ...]], pad_token_id: int
) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, position ids) of ``suffixes`` continuing rows whose ``cached_lengths``
    positions sit left-padded in a cache (:func:`stack_rows`) of width ``max(cached_lengths)``.

    The suffixes are left-padded too, so a row's padding is a gap between its cached and its new
    positions; the mask spans cache + suffix and hides both paddings, and positions continue each
    row's cached length. A padding query still sees its row's cached columns (no fully masked row)."""
    ids, suffix_mask, _ = left_padded(suffixes, pad_token_id)
    cached = torch.tensor(cached_lengths, dtype=torch.long)
    cache_width = int(cached.max())
    cache_mask = (torch.arange(cache_width)[None, :] >= (cache_width - cached)[:, None]).long()
    positions = (cached[:, None] + suffix_mask.cumsum(-1) - 1).clamp(min=0)
    return ids, torch.cat([cache_mask, suffix_mask], dim=-1), positions


def row_layers_after_gap(
    cache: Any, row: int, cache_width: int, cached_length: int, suffix_length: int
) -> Layers:
    """Row ``row``'s real positions in a cache built by a :func:`suffix_inputs` forward: the last
    ``cached_length`` of its first ``cache_width`` columns, then its last ``suffix_length`` (fresh tensors)."""
    rows, head = slice(row, row + 1), slice(cache_width - cached_length, cache_width)
    tail = width(cache) - suffix_length
    return [
        tuple(torch.cat([t[rows, :, head], t[rows, :, tail:]], dim=-2) for t in (layer.keys, layer.values))
        for layer in cache.layers
    ]


def own_row_layers(cache: Any, row: int, length: int) -> Layers:
    """:func:`row_layers` as copies (a kept row must not hold the whole batch cache alive), in one
    copy when every layer has the same shape: one kernel per kept row, not two per layer."""
    parts = [t for pair in row_layers(cache, row, length) for t in pair]
    if any(t.shape != parts[0].shape for t in parts):
        return [(keys.clone(), values.clone()) for keys, values in row_layers(cache, row, length)]
    own = torch.cat(parts)  # (2 * layers, H, length, D), every entry's tensors views of it
    return [(own[i : i + 1], own[i + 1 : i + 2]) for i in range(0, len(parts), 2)]
