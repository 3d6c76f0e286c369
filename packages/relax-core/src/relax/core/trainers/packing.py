"""Sequence packing: a micro-batch's rows as one sequence with no padding, attention kept per row.

The collate layout is a padded ``(B, P + R)`` rectangle (prompts left-padded, responses right-padded),
so a long-tailed batch runs mostly padding. Packed, the real tokens of every row are laid end to end
as one ``(1, T)`` sequence; each row keeps its own position ids, and ``cu_seqlens`` (cumulative row
lengths, the varlen convention of flash-attention) tells attention where rows start, so no token
attends across a row boundary.

Attention: HF's flash-attention implementations take ``cu_seq_lens_*`` as they are (varlen kernels).
Any other model is switched to the ``relax_packed`` implementation registered here: a packed call
runs causal SDPA row by row (each row exact, no ``T x T`` mask built), every other call is HF's own
SDPA. Models with sliding-window layers are not packed (their window would have to be per row).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

IMPLEMENTATION = "relax_packed"
_PACKED: ContextVar[bool] = ContextVar("relax_packed_call", default=False)
_registered = False


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("cu_seq_lens_q", None)  # only a packed forward passes it (and its recompute, later)
    sp = kwargs.pop("relax_sequence_parallel", None)  # Ulysses: this rank holds a slice of the tokens
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs = {k: kwargs[k] for k in ("dropout", "scaling") if k in kwargs}
    if sp is not None:  # a ``ulysses.SequenceParallel``: all tokens, this rank's heads
        query, key, value = (sp.heads_to_sequence(t) for t in (query, key, value))
    edges = bounds.tolist()
    causal = getattr(
        module, "is_causal", True
    )  # a decoder's attention; an encoder (vision tower) is not causal
    rows = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=causal, **kwargs
        )[0]
        for s, e in zip(edges[:-1], edges[1:], strict=True)
    ]
    out = torch.cat(rows, dim=1)  # (1, T, heads, head_dim), as sdpa_attention_forward returns
    if sp is not None:
        out = sp.sequence_to_heads(out)
    return out, None


def _mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED.get() else sdpa_mask(*args, **kwargs)


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, _attention)
        AttentionMaskInterface.register(IMPLEMENTATION, _mask)
        _registered = True


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run packed rows, or None."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "it has sliding-window attention layers"
    if not hasattr(model, "set_attn_implementation"):
        return "it is not a transformers model"
    return None


def enable_packing(model: torch.nn.Module) -> None:
    """Make ``model`` honour ``cu_seq_lens_*`` (see the module doc); raises ``ValueError`` naming why not."""
    if problem := packing_problem(model):
        raise ValueError(f"trainer.pack_sequences: {type(model).__name__} cannot be packed: {problem}")
    if not str(model.config._attn_implementation).startswith("flash_attention"):
        _register()
        model.set_attn_implementation(IMPLEMENTATION)


@dataclass(frozen=True)
class PackedRows:
    """Rows laid end to end: ``input_ids`` / ``position_ids`` (1, T), ``cu_seqlens`` (rows + 1,),
    ``targets`` (rows, R): the packed position whose output predicts each response token, -1 where
    the response has no token (its padding)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    targets: torch.Tensor


def pack_rows(batch: dict[str, Any]) -> PackedRows:
    """The packed form of a collate-layout ``batch`` (prompts left-padded, responses right-padded)."""
    mask = batch["attention_mask"].bool()
    resp = batch["responses"].shape[1]
    lengths = mask.sum(dim=-1)
    slot = mask.flatten().cumsum(0).sub(1).view_as(mask)  # each real token's packed position
    columns = torch.arange(
        mask.shape[1] - resp - 1, mask.shape[1] - 1, device=mask.device
    )  # predict tokens 0..R-1
    targets = torch.where(mask[:, columns], slot[:, columns], torch.full_like(slot[:, columns], -1))
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    return PackedRows(
        input_ids=batch["input_ids"][mask][None],
        position_ids=batch["position_ids"][mask][None],
        cu_seqlens=cu,
        max_len=int(lengths.max()),
        targets=targets,
    )


#: per-token forward keywords besides ``input_ids`` (a media adapter's token types), packed like the ids
_PER_TOKEN_SUFFIX = "token_type_ids"


def packed_media_kwargs(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any] | None:
    """``model``'s forward keywords for ``batch``'s media rows laid out packed: the adapter's keywords
    (``ModelAdapter.forward_kwargs``) with the ids and token types packed and the rotary positions its rope index
    gives the padded rows (``ModelAdapter.rope_positions``: M-RoPE's three axes), each row's own, packed the same
    way. None: the model's adapter gives no positions, so its media rows keep the padded forward."""
    from relax.core.data_multimodal import unpack_media
    from relax.core.multimodal_model import media_forward_kwargs, model_adapter

    rope_positions = getattr(model_adapter(model), "rope_positions", None)
    if rope_positions is None:
        return None
    ids, mask = batch["input_ids"], batch["attention_mask"]
    width = ids.shape[1] - batch["responses"].shape[1]
    kwargs = media_forward_kwargs(
        model, ids, mask, unpack_media(batch), width, observed=batch.get("observation_mask")
    )
    positions = rope_positions(model, kwargs)
    if positions is None:
        return None
    keep = mask.bool()
    out = {
        k: v[keep][None] if k == "input_ids" or k.endswith(_PER_TOKEN_SUFFIX) else v
        for k, v in kwargs.items()
        if k not in ("attention_mask", "position_ids")
    }
    out["position_ids"] = positions[:, keep][:, None]  # (axes, 1, T)
    return out


def packed_forward(model: torch.nn.Module, packed: PackedRows, **extra: Any) -> Any:
    """``model`` over the packed rows (no cache, no attention mask: ``cu_seqlens`` bound attention);
    ``extra`` reaches the attention function (``relax_sequence_parallel``: Ulysses), or is a media row's
    keywords (:func:`packed_media_kwargs`: ids and positions in place of the packed text ones)."""
    cu, longest = packed.cu_seqlens, packed.max_len
    extra = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, **extra}
    token = _PACKED.set(True)
    try:
        return model(
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            **extra,
        )
    finally:
        _PACKED.reset(token)
