"""Right padding for megatron's causal attention: no ``(B, 1, S, S)`` mask.

Core's batches left-pad prompts (every prompt ends at the same column) and right-pad responses. A
dense padding mask would cost O(B * S^2) memory per forward; instead each row is rotated left by its
number of leading pads, so every row is right-padded, and the model runs with ``attention_mask=None``
and megatron's causal mask type (the layer specs' ``AttnMaskType.causal``: Transformer Engine's fused /
flash attention with no mask tensor at all; the local spec one cached ``S x S`` causal mask shared by
every batch). Under causal attention a valid token never sees a trailing pad, and positions stay those
of the batch (``position_ids`` count valid tokens only), so the logits of valid tokens are those of the
masked left-padded forward. :func:`response_logits` reads the response-predicting positions back from
the rotated layout.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def left_pads(valid: Tensor) -> Tensor:
    """(B,) leading padding columns of each row of a (B, S) 0/1 ``attention_mask`` (S for an empty row)."""
    return (valid.cumsum(-1) == 0).sum(-1)


def rotate_left(t: Tensor, shift: Tensor) -> Tensor:
    """Each row of (B, S, ...) ``t`` rotated left by its ``shift`` (B,) columns."""
    s = t.shape[1]
    index = (torch.arange(s, device=t.device)[None] + shift.to(t.device)[:, None]) % s
    return t.gather(1, index.view(*index.shape, *([1] * (t.dim() - 2))).expand_as(t))


def right_padded(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(input_ids, position_ids) of ``batch`` with every row right-padded (the batch's own tensors when
    no row has leading pads)."""
    shift = left_pads(batch["attention_mask"])
    if not bool(shift.any()):
        return batch["input_ids"], batch["position_ids"]
    return rotate_left(batch["input_ids"], shift), rotate_left(batch["position_ids"], shift)


def response_logits(logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """(B, R, V) logits of the positions that predict ``batch["responses"]`` (``P-1 .. P+R-2`` in the
    left-padded layout), from the (B, S, V) ``logits`` of the :func:`right_padded` forward."""
    responses = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - responses
    shift = left_pads(batch["attention_mask"]).to(logits.device)
    if not bool(shift.any()):
        return logits[:, prompt_len - 1 : prompt_len - 1 + responses]
    rows = torch.arange(responses, device=logits.device)[None] + (prompt_len - 1 - shift)[:, None]
    return logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))


def pad_to_multiple(t: Tensor, dim: int, multiple: int) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to a multiple of ``multiple``: sequence parallelism splits the
    sequence over the TP ranks. Trailing columns of right-padded rows: no valid token attends to them."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)
