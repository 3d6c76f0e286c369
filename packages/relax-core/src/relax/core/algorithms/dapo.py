"""DAPO's data-side pieces (Yu et al. 2025, "DAPO", arXiv:2503.14476): dynamic sampling and soft
overlong punishment. Clip-higher is ``ppo``'s ``clip_ratio_high``; the token-level loss is
``loss_agg_mode="token-mean"``."""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_keep(rewards: Tensor, index: Tensor) -> Tensor:
    """(B,) bool: True for members of groups whose rewards are not all equal (DAPO Eq. 8 constraint
    ``0 < |{o_i correct}| < G``, generalised to any reward). Such groups give zero group-relative
    advantage and no gradient. A singleton group counts as all-equal and is dropped."""
    _, inv = torch.unique(index, return_inverse=True)
    n = int(inv.max().item()) + 1 if inv.numel() else 0
    r = rewards.detach()
    gmax = torch.zeros(n, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amax", include_self=False
    )
    gmin = torch.zeros(n, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, "amin", include_self=False
    )
    return (gmax != gmin)[inv]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty_factor: float = 1.0) -> Tensor:
    """Soft overlong punishment (DAPO Eq. 13), scaled by ``penalty_factor``:
    0 for ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer,
    -1 beyond ``L_max``. Add it to the task reward."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}"
        )
    expected = max_len - buffer
    penalty = (expected - lengths.to(torch.float32)) / buffer
    return torch.clamp(penalty, min=-1.0, max=0.0) * penalty_factor
