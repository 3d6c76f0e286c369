"""Continuous-batching state of the HF engine: the rows decoding now and the cache they share.

A row is one request. It joins with its context (prompt + any partial-rollout prefix) in the KV
cache and its first token already sampled from the prefill's logits, which it feeds in its first
decode step; so every decode step is one forward over all live rows, each yielding exactly one
sampled token, and a row that finishes leaves the batch (and the cache) right away. Its slot goes
to the next waiting request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from relax.core.engines import kv_batch
from relax.core.protocols import GenerationRequest


@dataclass(eq=False)
class Row:
    """One request in flight: its sampling inputs and the tokens it has produced so far."""

    request: GenerationRequest
    uniforms: list[float]  # one per token still to sample, drawn from the request's seed
    stop_ids: frozenset[int]
    epoch: int  # the engine's abort epoch when the request arrived
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""  # "" while running; then "stop" | "length" | "abort"
    error: Exception | None = None  # a failed decode step this row was part of
    routing: list[Any] = field(
        default_factory=list
    )  # MoE top-k experts per fed token, when recorded (engines.routing)

    @property
    def context(self) -> list[int]:
        return list(self.request.prompt_ids) + list(self.request.prefix_response_ids)

    @property
    def budget(self) -> int:
        return len(self.uniforms)


class DecodeBatch:
    """Live rows, their left-padded cache, per-row cached lengths and the token each feeds next."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[Row] = []
        self.cache: Any | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.next_ids = torch.zeros(0, dtype=torch.long, device=device)
        self._params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: list[Row], cache: Any | None) -> None:
        """Append ``rows`` whose context is in ``cache`` (row order) and whose first token is sampled."""
        self.cache = kv_batch.concat_rows(self.cache, len(self.rows), cache, len(rows))
        new_lengths = torch.tensor([len(r.context) for r in rows], dtype=torch.long, device=self.device)
        new_ids = torch.tensor([r.ids[-1] for r in rows], dtype=torch.long, device=self.device)
        self.lengths = torch.cat([self.lengths, new_lengths])
        self.next_ids = torch.cat([self.next_ids, new_ids])
        self.rows += rows
        self._params = None

    def decode_inputs(self) -> dict[str, Any]:
        """Model kwargs for one decode step of every live row."""
        return {
            "input_ids": self.next_ids[:, None],
            "attention_mask": kv_batch.attention_mask(self.lengths, kv_batch.width(self.cache)),
            "position_ids": self.lengths[:, None],
            "cache": self.cache,
            "use_cache": True,
        }

    def advance(self, cache: Any, next_ids: torch.Tensor) -> None:
        """After a decode step: the grown cache and the tokens the rows feed next."""
        if self.cache is None:
            kv_batch.check_layers(cache)
        self.cache = cache
        self.lengths = self.lengths + 1
        self.next_ids = next_ids

    def sampling_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p) per live row, rebuilt only when rows join or leave."""
        if self._params is None:
            self._params = row_sampling_params(self.rows, self.device)
        return self._params

    def drop_finished(self) -> None:
        """Remove finished rows from the batch and their columns from the cache."""
        keep = [i for i, r in enumerate(self.rows) if not r.finish]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self._params = None
        if not keep:
            self.cache = None
            self.lengths, self.next_ids = self.lengths[:0], self.next_ids[:0]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.lengths, self.next_ids = self.lengths[index], self.next_ids[index]
        if self.cache is not None:
            kv_batch.select_rows(self.cache, index)
            kv_batch.trim_left(self.cache, int(self.lengths.max()))


def row_sampling_params(
    rows: list[Row], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) of ``rows``, one entry per row."""
    params = [r.request.params for r in rows]
    return (
        torch.tensor([p.temperature for p in params], device=device),
        torch.tensor([p.top_k for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device),
    )
