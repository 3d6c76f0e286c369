"""The HF engine's prefill forwards: contexts left-padded from scratch, or only their new suffixes on top of
KV kept in the prefix cache. Each returns, per context, its own cache rows and its last logits (what the G
samples of a group share); the engine does the bookkeeping (which contexts, stats, routing)."""

from __future__ import annotations

from typing import Any

import torch

from relax.core.engines import kv_batch
from relax.core.engines.prefix_cache import PrefixHit

Prefilled = dict[tuple[int, ...], tuple[kv_batch.Layers, torch.Tensor]]


def forward_prefixes(
    model: Any, device: Any, pad_token_id: int, prefixes: list[tuple[int, ...]]
) -> tuple[Prefilled, torch.Tensor]:
    """One left-padded forward over ``prefixes``: each one's cache rows and last logits, and the input ids
    (what routing replay records)."""
    input_ids, attention, positions = kv_batch.left_padded(prefixes, pad_token_id)
    with torch.no_grad():
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
    kv_batch.check_layers(out.cache)
    last = out.logits[:, -1]
    return {
        p: (kv_batch.row_layers(out.cache, i, len(p)), last[i]) for i, p in enumerate(prefixes)
    }, input_ids


def forward_suffixes(
    model: Any, device: Any, pad_token_id: int, warm: list[tuple[tuple[int, ...], PrefixHit]]
) -> Prefilled:
    """One forward over the contexts' new suffixes on top of their cached prefixes' KV."""
    suffixes = [c[hit.length :] for c, hit in warm]
    past = kv_batch.stack_rows([hit.layers for _, hit in warm])
    cache_width = kv_batch.width(past)
    input_ids, attention, positions = kv_batch.suffix_inputs(
        [hit.length for _, hit in warm], suffixes, pad_token_id
    )
    with torch.no_grad():
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            position_ids=positions.to(device),
            cache=past,
            use_cache=True,
            logits_to_keep=1,
        )
    kv_batch.check_layers(out.cache)
    last = out.logits[:, -1]
    return {
        c: (kv_batch.row_layers_after_gap(out.cache, i, cache_width, hit.length, len(s)), last[i])
        for i, ((c, hit), s) in enumerate(zip(warm, suffixes, strict=True))
    }
