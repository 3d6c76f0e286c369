"""Static batching: the HF engine's text path for models whose KV cache cannot be cut row by row.

Continuous batching moves cache columns between rows (``engines.kv_batch``), which only plain
full-attention layers allow. A sliding-window layer (Gemma 3, Mistral-style models) keeps only the
last window of positions and its own count of tokens seen, and a linear-attention layer keeps a state
instead of columns; neither can be re-padded or stacked. Such a model decodes each call's requests as
fixed batches instead: one left-padded prefill, then one token per row per step until every row of
the batch has finished (a finished row stays in the batch, its logits ignored, so the cache the model
built keeps its shape). The engine drives the batches (``HFRolloutEngine._generate_apart``).

Positions and logprobs are those of the continuous path: each row's positions count its own tokens
from 0 and the padding is masked. A weight update while a batch decodes re-runs its prefill with the
new weights, as the media path does, so every token is scored by the weights whose version it records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relax.core.engines.kv_batch import left_padded

Sample = Callable[[list[Any], torch.Tensor], Any]  # the engine's: one token per row from its logits


def static_batches(
    rows: list[Any], max_batch_size: int, pad_token_id: int, device: torch.device
) -> list[StaticBatch]:
    """``rows`` (``Row`` objects) in arrival order, ``max_batch_size`` to a batch."""
    live = [r for r in rows if not r.finish]
    return [
        StaticBatch(live[i : i + max_batch_size], pad_token_id, device)
        for i in range(0, len(live), max_batch_size)
    ]


class StaticBatch:
    """Rows decoding together over one cache the model built itself (never cut or re-padded)."""

    def __init__(self, rows: list[Any], pad_token_id: int, device: torch.device) -> None:
        self.rows, self.pad_token_id, self.device = rows, pad_token_id, device
        self.cached: list[Any] = []  # the rows in the cache, in cache order
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.version: int | None = None

    def done(self) -> bool:
        return all(r.finish for r in self.rows)

    def step(self, model: Any, version: int, sample: Sample) -> None:
        """One token for every live row (the caller holds the engine's step lock)."""
        if self.cache is None or self.version != version:
            self._prefill(model, version, sample)
            return
        last = torch.tensor([[r.ids[-1]] for r in self.cached], dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.cached), 1)], dim=1)
        with torch.no_grad():
            out = model(
                input_ids=last,
                attention_mask=self.mask,
                position_ids=self.lengths[:, None],
                cache=self.cache,
                use_cache=True,
            )
        self.cache, self.lengths = out.cache, self.lengths + 1
        keep = [i for i, r in enumerate(self.cached) if not r.finish]
        sample([self.cached[i] for i in keep], out.logits[keep, -1])

    def _prefill(self, model: Any, version: int, sample: Sample) -> None:
        """One left-padded forward over the live rows' context + response so far."""
        self.cached = [r for r in self.rows if not r.finish]
        contexts = [r.context + r.ids for r in self.cached]
        ids, mask, positions = left_padded(contexts, self.pad_token_id)
        self.mask, self.lengths = (
            mask.to(self.device),
            torch.tensor([len(c) for c in contexts], device=self.device),
        )
        with torch.no_grad():
            out = model(
                input_ids=ids.to(self.device),
                attention_mask=self.mask,
                position_ids=positions.to(self.device),
                use_cache=True,
                logits_to_keep=1,
            )
        self.cache, self.version = out.cache, version
        sample(self.cached, out.logits[:, -1])
