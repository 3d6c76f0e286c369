"""Micro-batches sized in tokens, not rows (verl's ``use_dynamic_bsz``, slime's ``--max-tokens-per-gpu``).

A fixed row count makes memory depend on the longest row: one long-tail response pads the whole
micro-batch. Here rows are bin-packed by their real token count (prompt + response, no padding)
into micro-batches of at most ``max_tokens`` tokens, and each micro-batch is cut to its own columns
(the prompt padding no row of it needs on the left, the response padding on the right). Gradient
accumulation stays exact: core's loop normalises every micro-batch's loss by the step-global token
count, so the order and grouping of rows change nothing but float summation order.

A micro-batch remembers which rows it holds (``ROWS``) and the response width it was cut from
(``WIDTH``), so a per-row result (old logprobs) can be put back in the mini-batch's row order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relax.core.data_multimodal import has_media
from relax.core.policy_update.batching import _per_row, split_rows

ROWS, WIDTH = "\0rows", "\0width"  # a token-budget micro-batch's row indices and source response width


def row_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """(B,) real tokens per row: prompt + response positions the model attends to."""
    return batch["attention_mask"].sum(dim=-1)


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: row indices grouped so each group's token sum is at most ``max_tokens``
    (a row longer than the budget gets a group of its own). Groups come longest first; rows inside
    a group keep ascending order (stable across calls with the same lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return [sorted(g) for g in groups]


def pack_by_padded_tokens(widths: list[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Groups for a padded micro-batch, whose cost is rows x (longest prompt + longest response) of
    the group, not its real tokens: rows by total length, longest first, each group filled while that
    rectangle stays within ``max_tokens`` (a long row never pads a group of short ones)."""
    order = sorted(range(len(widths)), key=lambda i: (-sum(widths[i]), i))
    groups: list[list[int]] = []
    prompt = response = 0
    for i in order:
        p, r = max(prompt, widths[i][0]), max(response, widths[i][1])
        if groups and (len(groups[-1]) + 1) * (p + r) <= max_tokens:
            groups[-1].append(i)
            prompt, response = p, r
        else:
            groups.append([i])
            prompt, response = widths[i]
    return [sorted(g) for g in groups]


def balanced_order(lengths: list[int], world_size: int) -> list[int]:
    """A row permutation whose contiguous data-parallel shares (``batching.shard_bounds``: sizes differ
    by at most one) carry similar token counts: longest rows first, each to the share with the fewest
    tokens that still has room (greedy LPT with a cardinality limit)."""
    rows = len(lengths)
    sizes = [rows * (r + 1) // world_size - rows * r // world_size for r in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(rows), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(world_size) if len(shares[r]) < sizes[r]), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += lengths[i]
    return [i for share in shares for i in sorted(share)]


def select_rows(batch: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """Rows ``index`` (any order) of every per-row tensor; others passed as they are."""
    rows = batch["responses"].shape[0]
    return {k: v.index_select(0, index.to(v.device)) if _per_row(v, rows) else v for k, v in batch.items()}


def trim_columns(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` cut to the columns its rows use: leading prompt columns that are padding in every row
    and trailing response columns past the longest response. Media rows are left whole (their
    processor outputs are laid out per column)."""
    if has_media(batch):
        return batch
    mask, width = batch["attention_mask"], batch["input_ids"].shape[1]
    resp = batch["responses"].shape[1]
    prompt = width - resp
    used = mask.bool().any(dim=0)
    left = int(used[:prompt].int().argmax()) if bool(used[:prompt].any()) else prompt - 1
    left = min(left, prompt - 1)  # keep the last prompt column: it predicts the first response token
    keep_resp = int(mask[:, prompt:].sum(dim=-1).max()) if resp else 0
    keep_resp = max(keep_resp, 1) if resp else 0
    if left == 0 and keep_resp == resp:
        return batch
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and _per_row(v, mask.shape[0]):
            if v.shape[1] == width:
                v = v[:, left : prompt + keep_resp]
            elif v.shape[1] == resp:
                v = v[:, :keep_resp]
        out[k] = v
    return out


def row_widths(batch: dict[str, Any]) -> list[tuple[int, int]]:
    """(prompt tokens, response positions) per row: the columns a trimmed micro-batch keeps for it."""
    mask = batch["attention_mask"]
    split = mask.shape[1] - batch["responses"].shape[1]
    prompts, responses = mask[:, :split].sum(dim=-1).tolist(), mask[:, split:].sum(dim=-1).tolist()
    return [(int(p), int(r)) for p, r in zip(prompts, responses, strict=True)]


def token_micro_batches(batch: dict[str, Any], max_tokens: int, packed: bool = True) -> list[dict[str, Any]]:
    """``batch``'s rows as micro-batches of at most ``max_tokens`` tokens (one row alone when it is
    longer), each trimmed to its own columns and tagged with its rows (``ROWS``) and ``WIDTH``. ``packed``:
    the backend runs a micro-batch's real tokens only; else its padded rectangle counts."""
    if packed:
        groups = pack_by_tokens([int(n) for n in row_tokens(batch).tolist()], max_tokens)
    else:
        groups = pack_by_padded_tokens(row_widths(batch), max_tokens)
    out = []
    for group in groups:
        index = torch.tensor(group, dtype=torch.long)
        micro = trim_columns(select_rows(batch, index))
        micro[ROWS], micro[WIDTH] = index, batch["responses"].shape[1]
        out.append(micro)
    return out


def masked_micro_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """One fully masked row (row 0, ``response_mask`` 0): a micro-batch that contributes nothing, for a
    replica that must run as many forwards as its peers (each is a collective under FSDP)."""
    micro = trim_columns(select_rows(batch, torch.zeros(1, dtype=torch.long)))
    micro["response_mask"] = torch.zeros_like(micro["response_mask"])
    micro[ROWS], micro[WIDTH] = torch.zeros(0, dtype=torch.long), batch["responses"].shape[1]
    return micro


def scatter_rows(pieces: list[tuple[dict[str, Any], torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """Per-micro-batch (b, r) results put back as one (rows, width) tensor in the batch's row order
    (columns past a micro-batch's trimmed width are 0, as masked positions are)."""
    first = pieces[0][1]
    out = torch.zeros((rows, width), dtype=first.dtype, device=first.device)
    for micro, value in pieces:
        index = micro[ROWS].to(value.device)
        if index.numel():
            out[index, : value.shape[1]] = value
    return out


def in_row_order(pieces: list[tuple[dict[str, Any], torch.Tensor]], rows: int, width: int) -> torch.Tensor:
    """Per-micro-batch (b, r) results as one (rows, width) tensor: concatenated for row-count micro-batches
    (consecutive rows, full width), scattered back (``scatter_rows``) for token-budget ones."""
    if ROWS in pieces[0][0]:
        return scatter_rows(pieces, rows, width)
    return torch.cat([value for _, value in pieces])


def micro_batches(
    batch: dict[str, Any],
    rows: int,
    max_tokens: int = 0,
    packed: bool = False,
    equalize: Callable[[int], int] | None = None,
) -> list[dict[str, Any]]:
    """``rows`` rows at a time, or with ``max_tokens`` token-budget micro-batches (``packed``: real tokens
    count, else padded rectangles); ``equalize(count) -> count``: the most any replica runs (fully masked
    micro-batches make up the difference: under FSDP each forward is a collective)."""
    if not max_tokens:
        return list(split_rows(batch, rows))
    micros = token_micro_batches(batch, max_tokens, packed)
    most = equalize(len(micros)) if equalize is not None else len(micros)
    return micros + [masked_micro_batch(batch) for _ in range(most - len(micros))]


def most_over_replicas(
    count: int, rank: int, size: int, all_reduce_sum: Callable[[list[float]], list[float]]
) -> int:
    """The largest ``count`` of ``size`` replicas (one sum of a one-hot vector: ``ModelStep.all_reduce_sum``)."""
    if size == 1:
        return count
    counts = [0.0] * size
    counts[rank] = float(count)
    return int(max(all_reduce_sum(counts)))
