"""Per-token logprobs and entropy from vocab-sharded logits, without gathering the full vocabulary.

Each TP rank holds logits for its contiguous slice of the vocabulary; the softmax statistics are
combined with all-reduces over the TP group (a no-op at TP=1). The max is only for stability (no grad);
the sums go through megatron's differentiable all-reduce, so gradients reach every shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _reducer(group):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def reduce_sum(t: Tensor) -> Tensor:  # group None: the logits hold the whole vocabulary
        return t if group is None else reduce_from_tensor_model_parallel_region(t, group)

    return reduce_sum


def _shifted(local_logits: Tensor, group) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 logits minus the global max (``z``), ``exp(z)`` and its sum over the whole vocabulary."""
    logits = local_logits.float()
    shift = logits.detach().amax(dim=-1, keepdim=True)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    z = logits - shift
    exp = z.exp()
    return z, exp, _reducer(group)(exp.sum(dim=-1))


def _target_z(z: Tensor, targets: Tensor, vocab_start: int, group) -> Tensor:
    """``z`` of each target token, from the rank whose slice holds it."""
    local = targets - vocab_start
    here = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return _reducer(group)(torch.where(here, picked, torch.zeros_like(picked)))


def logprobs_and_entropy(
    local_logits: Tensor, targets: Tensor, vocab_start: int, group=None
) -> tuple[Tensor, Tensor]:
    """``(..., V_local)`` logits (computed in fp32) of the vocabulary slice starting at ``vocab_start`` and
    ``(...)`` target ids -> ``(log p(target), entropy)`` of the full softmax, both ``(...)``."""
    z, exp, sum_exp = _shifted(local_logits, group)
    log_z = sum_exp.log()
    expected_z = _reducer(group)((exp * z).sum(dim=-1)) / sum_exp
    return _target_z(z, targets, vocab_start, group) - log_z, log_z - expected_z


def logprobs_and_sum_pi_squared(
    local_logits: Tensor, targets: Tensor, vocab_start: int, group=None
) -> tuple[Tensor, Tensor]:
    """``(log p(target), sum_v p(v)^2)`` of the full softmax from vocab-sharded logits (no grad needed):
    ``sum_v exp(2 z_v) / (sum_v exp(z_v))^2``, each sum all-reduced over the TP group."""
    z, exp, sum_exp = _shifted(local_logits, group)
    sum_sq = _reducer(group)(exp.square().sum(dim=-1))
    return _target_z(z, targets, vocab_start, group) - sum_exp.log(), sum_sq / sum_exp.square()
