"""Clipped value-function loss for PPO critics."""

from __future__ import annotations

import torch
from torch import Tensor

from relax.core.algorithms.aggregation import aggregate_loss, masked_mean


def clipped_value_loss(
    new_values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float,
    agg: str = "token-mean",
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    ``new_values`` (V) are the critic's current predictions (with grad), ``old_values`` (V_old)
    the rollout-time values the clip is centred on. verl's ``compute_value_loss(vpreds, returns,
    values, ...)`` calls the current predictions ``vpreds`` and the *old* ones ``values``; the
    names here say which is which.

    The value clipping of OpenAI baselines' PPO2, written out in Engstrom et al. 2020
    (arXiv:2005.12729, §3, optimisation 1 "value function clipping"); as verl's
    ``compute_value_loss``. Metric ``vf_clip_frac``: fraction of valid tokens where the clipped
    term is the larger one. Masked positions (padding, observation spans) are zeroed first, so
    whatever is there never reaches the loss or, as ``0 * inf``, its gradient.
    """
    valid = mask > 0
    new_values, old_values, returns = (
        torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
        for x in (new_values, old_values, returns)
    )
    clipped = old_values + torch.clamp(new_values - old_values, -clip_range, clip_range)
    loss1 = (new_values - returns).square()
    loss2 = (clipped - returns).square()
    loss = 0.5 * aggregate_loss(
        torch.maximum(loss1, loss2),
        mask,
        agg,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
    )
    clip_frac = masked_mean((loss2 > loss1).to(new_values.dtype), mask.to(new_values.dtype))
    return loss, {"vf_clip_frac": float(clip_frac.item())}
