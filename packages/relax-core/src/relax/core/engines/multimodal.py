"""The HF engine's path for requests with media: a prefill with the prompt's media, then KV-cached decoding.

The text batcher assumes 1-D positions and text-only prefills, so media requests decode apart, group by
group (rows of a group share prompt, media and length: one unpadded batch). The prefill is exactly the
trainer's forward (same kwargs, model-computed M-RoPE positions); it leaves the model's rope delta (M-RoPE
position minus token index, per row), and each decode step feeds one token per row at position
``cache length + delta`` on all three M-RoPE axes, which is what the model's own rope index gives a text
token after the media. A weight update while a group decodes re-runs its prefill with the new weights (so
every token is scored by the weights whose version it records). ``engine.media_kv_cache = False`` keeps
the reference path instead: a full forward over prompt + response so far for every token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from relax.core.data_multimodal import model_inputs, resolve_all
from relax.core.multimodal_model import media_forward_kwargs, media_token_ids


@dataclass
class _Cached:
    """A group's KV cache for ``rows``: ``length`` positions each, their rope deltas, the weights' version."""

    rows: list[Any]
    cache: Any
    length: int
    delta: torch.Tensor  # (rows, 1)
    version: int


def _repeat(media: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v] * n) for k, v in media.items()}


async def generate_with_media(engine: Any, rows: list[Any], epoch: int) -> None:
    """Decode ``rows`` (``Row`` objects of ``engine``) to their finish, group by group."""
    media = resolve_all([r.request.media for r in rows])
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((id(media[i]), tuple(r.context)), []).append(i)
    use_cache = getattr(engine, "media_kv_cache", True)
    for index in groups.values():
        group = [rows[i] for i in index if not rows[i].finish]
        # None: a text-only row; source.* entries (original media for other engines) never reach the model
        inputs = {k: v.to(engine.device) for k, v in model_inputs(media[index[0]] or {}).items()}
        cached: _Cached | None = None
        while any(not r.finish for r in group):
            if engine._abort_epoch != epoch:
                for r in group:
                    r.finish = r.finish or "abort"
                return
            if not engine._running.is_set():
                await asyncio.sleep(0.005)
                continue
            with engine._step_lock:
                if use_cache:
                    cached = _cached_step(engine, group, inputs, cached)
                else:
                    live = [r for r in group if not r.finish]
                    engine._sample(live, _full_forward(engine, live, inputs, cache=False)[0])
            await asyncio.sleep(0)


def _full_forward(engine: Any, rows: list[Any], media: dict[str, torch.Tensor], cache: bool) -> tuple[torch.Tensor, Any]:
    """Last-position logits of prompt + response so far with the media; the KV cache when ``cache``."""
    ids = torch.tensor([r.context + r.ids for r in rows], dtype=torch.long, device=engine.device)
    kwargs = media_forward_kwargs(engine.model, ids, torch.ones_like(ids), _repeat(media, len(rows)),
                                  len(rows[0].request.prompt_ids))
    with torch.no_grad():
        out = engine.model(use_cache=cache, logits_to_keep=1, **kwargs)
    return out.logits[:, -1], (out.cache if cache else None)


def _cached_step(engine: Any, group: list[Any], media: dict[str, torch.Tensor], cached: _Cached | None) -> _Cached:
    """One token for the group's live rows. Rows that finish stay in the cached batch (their logits are
    ignored) so the cache keeps one shape; a (re-)prefill takes the live rows only, all of one length."""
    if cached is None or cached.version != engine._version:
        live = [r for r in group if not r.finish]
        _rope_holders(engine.model, reset=True)
        logits, cache = _full_forward(engine, live, media, cache=True)
        length = len(live[0].context) + len(live[0].ids)
        cached = _Cached(live, cache, length, _rope_deltas(engine.model, len(live)).to(engine.device), engine._version)
    else:
        rows = cached.rows
        last = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=engine.device)
        last = last.masked_fill(torch.isin(last, torch.tensor(media_token_ids(engine.model.config), device=last.device)), 0)
        position = (cached.delta + cached.length).view(1, len(rows), 1).expand(3, -1, -1)
        mask = torch.ones((len(rows), cached.length + 1), dtype=torch.long, device=engine.device)
        with torch.no_grad():
            out = engine.model(input_ids=last, attention_mask=mask, position_ids=position, cache=cached.cache,
                               use_cache=True)
        logits, cached.cache, cached.length = out.logits[:, -1], out.cache, cached.length + 1
    live = [i for i, r in enumerate(cached.rows) if not r.finish]
    engine._sample([cached.rows[i] for i in live], logits[live])
    return cached


def _rope_holders(model: Any, reset: bool = False) -> list[Any]:
    """The modules that keep M-RoPE deltas between forwards (``reset``: cleared, so none is stale)."""
    holders = [m for m in model.modules() if hasattr(m, "rope_deltas")]
    for m in holders if reset else ():
        m.rope_deltas = None
    return holders


def _rope_deltas(model: Any, rows: int) -> torch.Tensor:
    """The M-RoPE deltas the prefill left on the model; 0 when it computed none (plain 1-D positions)."""
    for module in _rope_holders(model):
        if isinstance(module.rope_deltas, torch.Tensor):
            return module.rope_deltas.reshape(-1, 1).expand(rows, 1).to(torch.long)
    return torch.zeros((rows, 1), dtype=torch.long)


