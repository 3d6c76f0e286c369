"""The HF engine's path for requests with media: a prefill with the prompt's media, then KV-cached decoding.

The text batcher assumes 1-D positions and text-only prefills, so media requests decode apart, group by
group (rows of a group share prompt, media and length: one unpadded batch; the engine drives the groups,
``HFRolloutEngine._generate_apart``). The prefill is exactly the trainer's forward (same kwargs from the
model's adapter, ``relax.core.multimodal_model``); the adapter then says which positions each decode step
feeds (for M-RoPE models: the prefill's per-row offset plus the cache length on every axis, which is what
the model's own position function gives a text token after the media). A weight update while a group
decodes re-runs its prefill with the new weights (so every token is scored by the weights whose version
it records). ``engine.media_kv_cache = False`` keeps the reference path instead: a full forward over
prompt + response so far for every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relax.core.data_multimodal import model_inputs, resolve_all
from relax.core.multimodal_model import media_forward_kwargs, media_token_ids, model_adapter

Sample = Callable[[list[Any], torch.Tensor], Any]  # the engine's: one token per row from its logits


def media_groups(rows: list[Any], device: torch.device, use_cache: bool = True) -> list[MediaGroup]:
    """``rows`` (``Row`` objects) grouped by media and context: each group decodes as one batch."""
    media = resolve_all([r.request.media for r in rows])
    index: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, r in enumerate(rows):
        index.setdefault((id(media[i]), tuple(r.context)), []).append(i)
    # None: a text-only row; source.* entries (original media for other engines) never reach the model
    return [
        MediaGroup(
            [rows[i] for i in ids],
            {k: v.to(device) for k, v in model_inputs(media[ids[0]] or {}).items()},
            device,
            use_cache,
        )
        for ids in index.values()
    ]


def _repeat(media: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v] * n) for k, v in media.items()}


class MediaGroup:
    """One group's decode state: its rows, their media and, with the KV cache, the cache of ``rows_cached``
    (``length`` positions each), the adapter's decode positions and the weights' version."""

    def __init__(
        self, rows: list[Any], media: dict[str, torch.Tensor], device: torch.device, use_cache: bool
    ) -> None:
        self.rows = [r for r in rows if not r.finish]
        self.media, self.device, self.use_cache = media, device, use_cache
        self.rows_cached: list[Any] = []
        self.cache: Any = None
        self.length = 0
        self.positions: Callable[[int], torch.Tensor] | None = None
        self.version: int | None = None

    def done(self) -> bool:
        return all(r.finish for r in self.rows)

    def step(self, model: Any, version: int, sample: Sample) -> None:
        """One token for every live row (the caller holds the engine's step lock)."""
        live = [r for r in self.rows if not r.finish]
        if not self.use_cache:
            sample(live, self._forward(model, live, cache=False)[0])
            return
        if self.cache is None or self.version != version:
            self._prefill(model, live, version, sample)
            return
        rows = self.rows_cached  # rows that finish stay in the cached batch (logits ignored): one cache shape
        last = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        last = last.masked_fill(
            torch.isin(last, torch.tensor(media_token_ids(model.config), device=last.device)), 0
        )
        mask = torch.ones((len(rows), self.length + 1), dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = model(
                input_ids=last,
                attention_mask=mask,
                position_ids=self.positions(self.length).to(self.device),
                cache=self.cache,
                use_cache=True,
            )
        self.cache, self.length = out.cache, self.length + 1
        keep = [i for i, r in enumerate(rows) if not r.finish]
        sample([rows[i] for i in keep], out.logits[keep, -1])

    def _prefill(self, model: Any, live: list[Any], version: int, sample: Sample) -> None:
        """A (re-)prefill of the live rows, all of one length, with the current weights."""
        adapter = model_adapter(model)
        if adapter is not None:  # None: media_forward_kwargs refuses the media, naming the model type
            adapter.before_prefill(model)
        logits, self.cache = self._forward(model, live, cache=True)
        self.rows_cached, self.version = live, version
        self.length = len(live[0].context) + len(live[0].ids)
        self.positions = adapter.decode_positions(model, len(live))
        sample(live, logits)

    def _forward(self, model: Any, rows: list[Any], cache: bool) -> tuple[torch.Tensor, Any]:
        """Last-position logits of prompt + response so far with the media; the KV cache when ``cache``."""
        ids = torch.tensor([r.context + r.ids for r in rows], dtype=torch.long, device=self.device)
        kwargs = media_forward_kwargs(
            model, ids, torch.ones_like(ids), _repeat(self.media, len(rows)), len(rows[0].request.prompt_ids)
        )
        with torch.no_grad():
            out = model(use_cache=cache, logits_to_keep=1, **kwargs)
        return out.logits[:, -1], (out.cache if cache else None)
