"""Masked reductions and loss aggregation modes.

Every reduction reads values only where ``mask`` is non-zero (``torch.where``, so garbage or
inf at masked positions never leaks in) and never divides by zero: an empty selection gives 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    picked = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def safe_div(num: Tensor, den: Tensor | float) -> Tensor:
    """``num / den`` where ``den > 0``, else 0 (no NaN from empty selections)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return safe_div(masked_sum(values, mask, dim), mask.sum() if dim is None else mask.sum(dim=dim))


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased``, as verl's ``masked_var``).

    Deliberate deviation: verl raises for an empty selection, and for a single entry when
    ``unbiased``; here both give 0, so a tiny micro-batch cannot crash a run.
    """
    n = mask.sum()
    centered = torch.where(mask > 0, values - masked_mean(values, mask), torch.zeros_like(values))
    den = n - 1 if unbiased else n
    return safe_div(masked_sum(centered**2, mask), den)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var_unbiased + eps)`` over the masked entries, zero where masked;
    ``shift_mean=False`` adds the mean back (rescale only), as verl's ``masked_whiten``.

    Same statistics as verl (Bessel-corrected variance). Deliberate deviation: verl raises for
    fewer than two valid entries; here they are only centred (0 entries give zeros, 1 entry gives
    0, or ``x`` itself with ``shift_mean=False``), so a tiny micro-batch cannot crash a run.
    """
    mean = masked_mean(values, mask)
    centered = torch.where(mask > 0, values - mean, torch.zeros_like(values))
    out = centered if mask.sum() <= 1 else centered * torch.rsqrt(masked_var(values, mask) + eps)
    return out if shift_mean else torch.where(mask > 0, out + mean, out)


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    Modes:

    - ``token-mean``: sum over valid tokens / number of valid tokens (DAPO, arXiv:2503.14476
      Eq. 8, the 1/sum|o_i| token-level loss).
    - ``token-sum``: sum over valid tokens.
    - ``seq-mean-token-sum``: per-sequence token sum, averaged over sequences.
    - ``seq-mean-token-mean``: per-sequence token mean, averaged over sequences (GRPO,
      arXiv:2402.03300 Eq. 3).
    - ``seq-mean-token-sum-norm``: per-sequence token sum / ``loss_scale_factor`` (default: the
      padded length T), averaged over sequences (Dr. GRPO, arXiv:2503.20783 §3.2, constant
      normaliser).

    Sequences whose mask is all zero are excluded from sequence counts. ``global_token_count`` /
    ``global_seq_count`` replace the local denominators: pass the step-batch totals and summing
    ``aggregate_loss`` over micro-batches equals the full-batch value (gradients included). With
    data parallelism whose gradients are averaged over ranks, multiply by the world size.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(AGG_MODES)}")
    mask = mask.to(values.dtype)
    if mode == "token-sum":
        return masked_sum(values, mask)
    if mode == "token-mean":
        count = mask.sum() if global_token_count is None else global_token_count
        return safe_div(masked_sum(values, mask), count)
    lengths = mask.sum(dim=-1)
    seq_sums = masked_sum(values, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = safe_div(seq_sums, lengths)
    else:
        per_seq = seq_sums / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    count = (lengths > 0).sum().to(values.dtype) if global_seq_count is None else global_seq_count
    return safe_div(per_seq.sum(), count)
