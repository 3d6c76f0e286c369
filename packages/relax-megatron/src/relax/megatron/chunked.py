"""Response-token scores a chunk of tokens at a time, vocab-parallel (core's ``token_stats`` for megatron).

Full logits are ``tokens x V / TP`` floats per rank; at 8K response tokens and Qwen3's vocabulary that is
gigabytes of fp32 before the backward. Here the output layer runs on a chunk of hidden states at a time and
each chunk's logits are dropped as soon as its scores exist; with grad, each chunk is recomputed in backward
(``torch.utils.checkpoint``), so only the chunk's hidden states are kept. Under TP the logits stay
vocab-parallel: each rank multiplies by its slice of the output weight and the scores all-reduce their
softmax statistics (:mod:`relax.megatron.logprobs`), exactly as on the full-logits path.

The hidden states come from the model's own forward: :class:`OutputPassthrough` swaps the output layer's
``forward`` for one that returns its input, brought into the tensor-parallel region once (all-gathered over
the sequence under sequence parallelism, whose backward reduce-scatters; as it is otherwise, its gradient
all-reduced) — what megatron's ``ColumnParallelLinear`` does to its input before the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over TP (each rank's vocabulary slice gives part
    of it). Megatron's ``copy_to_tensor_model_parallel_region`` does this too, but all-reduces a contiguous
    copy of a non-contiguous gradient and returns the original, unreduced: the gradient arriving here is
    the transpose of the model's ``[b, s, h]`` output, non-contiguous."""

    @staticmethod
    def forward(ctx, hidden: Tensor, group) -> Tensor:
        ctx.group = group
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class OutputPassthrough:
    """Inside :meth:`hidden_out`, ``model``'s output layer returns its (TP-region) input, so the model's
    "logits" are its last hidden states, and :attr:`weight` is the weight it would have multiplied by
    (its own, or the tied embedding's)."""

    def __init__(
        self, model: torch.nn.Module, tp_group, tensor_parallel: int, sequence_parallel: bool
    ) -> None:
        self.layer = model.output_layer
        self.tp_group, self.tp, self.sequence_parallel = tp_group, tensor_parallel, sequence_parallel
        self.weight: Tensor | None = None

    def _enter_tp_region(self, hidden: Tensor) -> Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        return _SumGradOverTP.apply(hidden, self.tp_group) if self.tp > 1 else hidden

    def _passthrough(self, input_: Tensor, weight: Tensor | None = None, **_) -> tuple[Tensor, None]:
        self.weight = self.layer.weight if weight is None else weight
        return self._enter_tp_region(input_), None

    @contextmanager
    def hidden_out(self) -> Iterator[None]:
        self.layer.forward = self._passthrough  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            del self.layer.forward


def chunked_scores(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor,
    score: Callable[[Tensor, Tensor], tuple],
    chunk_tokens: int,
) -> tuple[Tensor, ...]:
    """``score(logits, targets)`` of ``hidden`` (B, R, H) under ``logits = hidden @ weight.T``, ``chunk_tokens``
    of the B x R tokens at a time; each output (B, R). ``score`` returns a tuple of per-token tensors."""
    rows, cols = targets.shape
    flat, tokens = hidden.reshape(rows * cols, hidden.shape[-1]), targets.reshape(-1)

    def scores(h: Tensor, t: Tensor) -> Tensor:
        return torch.stack(score(h.matmul(weight.t()), t))

    n = flat.shape[0]
    size = chunk_tokens if chunk_tokens > 0 else max(n, 1)
    recompute = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad) and n > size
    parts = []
    for start in range(0, max(n, 1), size):
        args = (flat[start : start + size], tokens[start : start + size])
        parts.append(checkpoint(scores, *args, use_reentrant=False) if recompute else scores(*args))
    return tuple(torch.cat(parts, dim=1).reshape(-1, rows, cols).unbind(0))
