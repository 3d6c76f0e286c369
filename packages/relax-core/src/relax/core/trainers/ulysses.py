"""Ulysses-style context parallelism: one packed sequence split across ranks (DeepSpeed-Ulysses,
Jacobs et al. 2023, arXiv:2309.14509, section 3).

Each of the ``size`` ranks holds a contiguous ``1 / size`` slice of the packed tokens and runs every
token-wise part of the model (embeddings, norms, MLPs, the head) on its slice only. Attention needs
the whole sequence: an all-to-all turns "my tokens, all heads" into "all tokens, my heads", attention
runs row by row over the whole sequence for ``heads / size`` heads, and a second all-to-all turns it
back. Activations per rank shrink by ``size``; both all-to-alls are differentiable.

Every rank of the group sees the same rows: each computes the logprobs of the response tokens in its
slice, and :func:`sum_over_ranks` assembles the whole ``(k, B, R)`` stats on every rank. Every rank then
computes the same loss, so the backward of that sum is the identity (each rank back-propagates into its
own tokens only) and the gradients summed over ranks (FSDP's reduce-scatter) are the full-sequence ones.
With data parallelism alongside, the fsdp trainer runs one such group per replica (``fsdp/layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from relax.core.trainers.packing import PackedRows


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in a Ulysses group (``group`` None: the default group)."""

    rank: int
    size: int
    group: Any = None

    def local(self, packed: PackedRows) -> tuple[PackedRows, int]:
        """This rank's slice of ``packed`` (padded to a multiple of ``size`` by a padding row of its own,
        so no real row attends to it) and the slice's first packed position. ``cu_seqlens`` stay global:
        attention runs over the whole sequence."""
        total = packed.input_ids.shape[1]
        width = -(-total // self.size)
        pad = width * self.size - total
        ids, pos, cu = packed.input_ids, packed.position_ids, packed.cu_seqlens
        if pad:
            ids = torch.cat([ids, ids.new_zeros((1, pad))], dim=1)
            pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1)
            cu = torch.cat([cu, cu.new_tensor([total + pad])])
        start = self.rank * width
        local = replace(
            packed,
            input_ids=ids[:, start : start + width],
            position_ids=pos[:, start : start + width],
            cu_seqlens=cu,
        )
        return local, start

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, L, d) of this rank's tokens -> (1, H / size, size * L, d) of all tokens, this rank's heads."""
        _, heads, length, dim = x.shape
        chunks = x.reshape(
            self.size, heads // self.size, length, dim
        )  # head chunk j -> rank j (q/k/v come transposed)
        got = _exchange(chunks, self.group)  # (size: source rank = sequence slice, H / size, L, d)
        return got.permute(1, 0, 2, 3).reshape(1, heads // self.size, self.size * length, dim)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(1, size * L, H / size, d) attention output of all tokens -> (1, L, H, d) of this rank's tokens."""
        _, total, heads, dim = x.shape
        length = total // self.size
        chunks = x.reshape(self.size, length, heads, dim)  # sequence slice j -> rank j
        got = _exchange(chunks, self.group)  # (size: source rank = head chunk, L, H / size, d)
        return got.permute(1, 0, 2, 3).reshape(1, length, self.size * heads, dim)


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable all-to-all of ``x`` (size, ...): chunk ``j`` goes to rank ``j``; chunk ``i`` of
    the result came from rank ``i``."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()  # the output is laid out like x: both must be plain row-major
    return all_to_all_single(torch.empty_like(x), x, group=group)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # every rank computes the same loss from the sum: its own part's gradient as is


def sum_over_ranks(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Each rank's disjoint part of ``x`` (zeros elsewhere) summed into the whole, on every rank."""
    return _SumOverRanks.apply(x, sp.group)


def check_heads(model: torch.nn.Module, size: int) -> None:
    """Ulysses splits attention heads over the ranks: query and key/value heads must divide by ``size``."""
    config = getattr(model.config, "text_config", None) or model.config
    heads, kv = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    if heads % size or kv % size:
        raise ValueError(
            f"trainer.backend_params.context_parallel: {size} must divide the model's attention heads "
            f"({heads} query, {kv} key/value)"
        )
