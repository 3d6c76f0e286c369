"""The HF engine's path for requests with media: one full forward per token over the group's rows.

The KV-cache batcher assumes 1-D positions and text-only prefills; a media request instead re-runs the
model on prompt + response so far with the prompt's media every step, exactly the forward the trainer
runs (same kwargs, same model-computed M-RoPE positions), so rollout and trainer logprobs agree. Rows of
one group share the prompt, media and length, so they decode as one unpadded batch. Quadratic in the
response length: meant for short responses and small models (tests, CPU examples).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from relax.core.data_multimodal import resolve_all
from relax.core.engines.sampling import sample_tokens, sampling_logprobs
from relax.core.multimodal_model import media_forward_kwargs


def _repeat(media: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v] * n) for k, v in media.items()}


async def generate_with_media(engine: Any, rows: list[Any], epoch: int) -> None:
    """Decode ``rows`` (``Row`` objects of ``engine``) to their finish, group by group."""
    media = resolve_all([r.request.media for r in rows])
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((id(media[i]), tuple(r.context)), []).append(i)
    for index in groups.values():
        live = [rows[i] for i in index if not rows[i].finish]
        inputs = {k: v.to(engine.device) for k, v in (media[index[0]] or {}).items()}  # None: text-only row
        while live:
            if engine._abort_epoch != epoch:
                for r in live:
                    r.finish = r.finish or "abort"
                return
            if not engine._running.is_set():
                await asyncio.sleep(0.005)
                continue
            with engine._step_lock:
                _step(engine, live, inputs)
            live = [r for r in live if not r.finish]
            await asyncio.sleep(0)


def _step(engine: Any, live: list[Any], media: dict[str, torch.Tensor]) -> None:
    ids = torch.tensor([r.context + r.ids for r in live], dtype=torch.long, device=engine.device)
    media = _repeat(media, len(live))
    kwargs = media_forward_kwargs(engine.model, ids, torch.ones_like(ids), media, len(live[0].request.prompt_ids))
    with torch.no_grad():
        logits = engine.model(use_cache=False, logits_to_keep=1, **kwargs).logits[:, -1]
    params = [r.request.params for r in live]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    top_k = torch.tensor([p.top_k for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    lps = sampling_logprobs(logits, temperature, top_k, top_p)
    uniforms = torch.tensor([r.uniforms[len(r.ids)] for r in live], dtype=torch.float64, device=logits.device)
    tokens = sample_tokens(lps, uniforms, temperature <= 0, logits)
    token_lps = lps.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    for row, tok, lp in zip(live, tokens.tolist(), token_lps, strict=True):
        row.ids.append(tok)
        row.logprobs.append(lp)
        row.versions.append(engine._version)
        row.finish = engine._finish_reason(row, tok)
    engine.stats["decode_steps"] += 1
    engine.stats["decode_rows"] += len(live)
