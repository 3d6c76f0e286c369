"""Row bookkeeping of a policy update: mini-batches, micro-batches and data-parallel shares.

A batch is a dict of per-row tensors (first dimension = rows, the length of ``responses``) and
per-batch values (anything else: passed through unchanged). Every helper slices rows only, so a
mini-batch or a replica's share is a batch again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _per_row(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def take_rows(batch: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """Rows ``[start, end)`` of every per-row tensor in ``batch`` (others passed as they are)."""
    rows = batch["responses"].shape[0]
    return {k: v[start:end] if _per_row(v, rows) else v for k, v in batch.items()}


def split_rows(batch: dict[str, Any], size: int) -> Iterator[dict[str, Any]]:
    """Consecutive slices of ``size`` rows (the last may be shorter)."""
    rows = batch["responses"].shape[0]
    for start in range(0, rows, size):
        yield take_rows(batch, start, start + size)


def shard_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous rows ``[start, end)`` of ``rows`` (sizes differ by at most one)."""
    return rows * rank // world_size, rows * (rank + 1) // world_size


def replica_rows(batch: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s contiguous share of the rows. A rank with no rows takes one fully masked copy
    of row 0: it still joins every collective of the update, contributing 0."""
    start, end = shard_bounds(batch["responses"].shape[0], rank, world_size)
    if end > start:
        return take_rows(batch, start, end)
    rows = take_rows(batch, 0, 1)
    rows["response_mask"] = torch.zeros_like(rows["response_mask"])
    return rows


def even_replica_rows(batch: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s share padded with fully masked copies of row 0 to the largest share's size:
    every rank then runs the same number of micro-batches, as a sharded model needs (each forward
    is a collective). The padding contributes 0."""
    rows = batch["responses"].shape[0]
    start, end = shard_bounds(rows, rank, world_size)
    size = max(e - s for s, e in (shard_bounds(rows, r, world_size) for r in range(world_size)))
    share = take_rows(batch, start, end)
    if end - start == size:
        return share
    pad = take_rows(batch, 0, 1)
    pad["response_mask"] = torch.zeros_like(pad["response_mask"])
    missing = size - (end - start)
    return {
        k: torch.cat([v] + [pad[k]] * missing) if _per_row(batch[k], rows) else v for k, v in share.items()
    }
