"""Sampling math for the HF engine: pure functions over a batch of next-token logits.

Every row carries its own temperature / top-k / top-p, so one batch can mix requests. Sampling
is inverse-CDF on per-request uniforms drawn up front, which makes a seeded request's tokens
independent of which other requests share its batch (up to float noise in the model forward).
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """(B, V) fp32 log-probs of the distribution each row samples from.

    Order as in HF/vLLM: divide by temperature, keep the ``top_k`` largest (0 = all), then the
    smallest prefix of the sorted distribution whose mass reaches ``top_p``. Masked tokens get
    ``-inf``. Rows with ``temperature <= 0`` are greedy; they get the plain (temperature 1)
    log-softmax, so their logprobs stay comparable with a trainer's forward pass.
    """
    greedy = temperature <= 0
    x = logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None]
    vocab = x.shape[-1]
    if bool(((top_k <= 0) | (top_k >= vocab)).all() and (top_p >= 1.0).all()):
        # nothing to truncate: skip the sort over the vocabulary (the common RL setting)
        return torch.where(greedy[:, None], logits.float(), x).log_softmax(dim=-1)
    sorted_x = x.sort(dim=-1, descending=True).values
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).long()
    kth = sorted_x.gather(-1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # keep a token while the mass strictly before it is below top_p (the first is always kept)
    keep = (probs.cumsum(dim=-1) - probs) < top_p.float()[:, None]
    keep |= (top_p >= 1.0)[:, None]
    keep &= sorted_x > float("-inf")
    cutoff = sorted_x.gather(-1, (keep.sum(dim=-1) - 1).clamp(min=0)[:, None])
    x = x.masked_fill(x < cutoff, float("-inf"))
    x = torch.where(greedy[:, None], logits.float(), x)
    return x.log_softmax(dim=-1)


def sample_tokens(
    logprobs: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor, raw_logits: torch.Tensor
) -> torch.Tensor:
    """(B,) token ids: inverse-CDF draw from ``exp(logprobs)`` with one uniform in [0, 1) per row,
    argmax of ``raw_logits`` where ``greedy``."""
    probs = logprobs.double().exp()
    cdf = probs.cumsum(dim=-1)
    target = uniforms.double() * cdf[:, -1]
    drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    # rounding can push the target to the total mass; never return a zero-probability token
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_allowed = torch.where(probs > 0, positions, 0).amax(dim=-1)
    drawn = torch.minimum(drawn, last_allowed)
    return torch.where(greedy, raw_logits.argmax(dim=-1), drawn)
