"""Data x context parallelism for the fsdp trainer: which ranks split one sequence, which hold other rows.

``world_size = dp_size x context_parallel``. Rank ``r`` is context-parallel rank ``r % C`` of data-parallel
replica ``r // C`` (``C = context_parallel``): a **CP group** is ``C`` consecutive ranks (they run the same
rows, each a ``1 / C`` slice of every packed micro-batch's tokens; on a cluster, ranks of one node, where the
attention all-to-alls are cheapest); a **DP group** is the ranks with the same CP rank, one per replica
(``r, r + C, r + 2C, ...``): the loop's token / sequence counts and metric sums are summed over it, once per
replica. Rows are spread over the ``dp_size`` replicas as without CP (token-balanced with a budget); the
logprobs go back to the controller from the CP rank 0 of every replica (the DP group of rank 0).

FSDP2 shards the weights over all ``world_size`` ranks (one ``shard`` mesh dimension, the flattened
``("dp", "cp")`` mesh) and sums every gradient over them. That sum is exactly the data-parallel one: within
a CP group each rank back-propagates the replica's loss into its own tokens (``ulysses``), so the group's sum
is the replica's full-sequence gradient, and the sum over the groups adds up the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def layout_problem(world_size: int, context_parallel: int) -> str | None:
    """Why ``context_parallel`` cannot split ``world_size`` ranks (None when it can)."""
    if context_parallel < 1 or world_size % context_parallel:
        return (
            f"context_parallel: must be >= 1 and divide world_size ({world_size}): the ranks form "
            f"world_size / context_parallel data-parallel replicas of context_parallel ranks each; "
            f"got {context_parallel}"
        )
    return None


@dataclass(frozen=True)
class Layout:
    """Rank ``rank`` of ``world_size`` with ``context_parallel`` ranks per sequence."""

    rank: int
    world_size: int
    context_parallel: int = 1

    def __post_init__(self) -> None:
        if problem := layout_problem(self.world_size, self.context_parallel):
            raise ValueError(f"trainer.backend_params.{problem}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")

    @property
    def cp_size(self) -> int:
        return self.context_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.context_parallel

    @property
    def cp_rank(self) -> int:
        return self.rank % self.context_parallel

    @property
    def dp_rank(self) -> int:
        return self.rank // self.context_parallel

    def cp_groups(self) -> list[list[int]]:
        """Every CP group's ranks (consecutive), in replica order."""
        c = self.context_parallel
        return [list(range(d * c, (d + 1) * c)) for d in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Every DP group's ranks (one per replica), in CP-rank order; the first holds rank 0."""
        c = self.context_parallel
        return [list(range(k, self.world_size, c)) for k in range(c)]

    @property
    def answers(self) -> bool:
        """Whether this rank's scores travel to the controller: CP rank 0 of its replica (rank 0 gathers)."""
        return self.cp_rank == 0


def process_groups(layout: Layout) -> tuple[Any, Any]:
    """(this rank's CP group, its DP group) as torch process groups; None where a group would be
    the whole world (the default group serves) or is unused. Every rank creates every group, in the
    same order, as ``torch.distributed.new_group`` requires."""
    import torch.distributed as dist

    cp_group = dp_group = None
    if layout.cp_size == 1:
        return None, None  # plain data parallelism over the default group
    # the all-to-alls get a group of their own (as DeepSpeed-Ulysses): never queued behind FSDP's prefetches
    for ranks in layout.cp_groups():
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            cp_group = group
    if layout.dp_size > 1:
        for ranks in layout.dp_groups():
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                dp_group = group
    return cp_group, dp_group


def gather_rows(local: Any, rows: int, layout: Layout, dp_group: Any) -> Any:
    """Every replica's ``local_rows`` results (padded shares, on the group's device) as the batch's
    ``rows`` rows, on rank 0; None elsewhere. Under context parallelism every rank of a CP group holds
    its replica's: CP rank 0 of each replica sends them (the DP group of rank 0), the others take no part."""
    import torch
    import torch.distributed as dist

    from relax.core.policy_update.batching import shard_bounds

    if not layout.answers:
        return None
    shares = [torch.empty_like(local) for _ in range(layout.dp_size)]  # NCCL gathers into CUDA
    dist.all_gather(shares, local, group=dp_group)
    if layout.rank != 0:
        return None
    bounds = [shard_bounds(rows, d, layout.dp_size) for d in range(layout.dp_size)]
    return torch.cat([share[: e - s] for share, (s, e) in zip(shares, bounds, strict=True)]).cpu()


def world_sum(value: float, device: Any) -> float:
    """``value`` summed over every rank (torch's default group; ``value`` itself without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)
