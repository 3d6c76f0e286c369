"""Per-token logprobs and entropy from vocab-sharded logits, without gathering the full vocabulary.

Each TP rank holds logits for its contiguous slice of the vocabulary; the softmax statistics are
combined with all-reduces over the TP group (a no-op at TP=1). The max is only for stability (no grad);
the sums go through megatron's differentiable all-reduce, so gradients reach every shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def logprobs_and_entropy(local_logits: Tensor, targets: Tensor, vocab_start: int, group=None) -> tuple[Tensor, Tensor]:
    """``(..., V_local)`` logits (computed in fp32) of the vocabulary slice starting at ``vocab_start`` and
    ``(...)`` target ids -> ``(log p(target), entropy)`` of the full softmax, both ``(...)``."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    def reduce_sum(t: Tensor) -> Tensor:  # group None: the logits hold the whole vocabulary
        return t if group is None else reduce_from_tensor_model_parallel_region(t, group)

    logits = local_logits.float()
    shift = logits.detach().amax(dim=-1, keepdim=True)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    z = logits - shift
    exp = z.exp()
    sum_exp = reduce_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = z.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_z = reduce_sum(torch.where(here, picked, torch.zeros_like(picked)))
    expected_z = reduce_sum((exp * z).sum(dim=-1)) / sum_exp
    return target_z - log_z, log_z - expected_z
