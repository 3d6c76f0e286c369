"""A tiny trainer plugin whose export is a real collective: every weight is sharded across the ranks
of its gloo group and ``export_weights`` all-gathers it (loaded by rank actors through ``RELAX_PLUGINS``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from relax.core.hookspecs import hookimpl

NUM_WEIGHTS = 3
SHARD = 4


def shard(rank: int, index: int) -> torch.Tensor:
    return torch.arange(SHARD, dtype=torch.float32) + 100 * index + 10 * rank


@dataclass(frozen=True)
class GatherParams:
    collective_timeout_s: float = 3.0  # a lone rank in a gather fails after this, not gloo's 30 min


class GatherTrainer:
    collective_export = True

    def __init__(self, params: GatherParams, ctx):
        self.rank, self.world = ctx.index, ctx.world_size
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=120),
        )
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=params.collective_timeout_s))
        self.steps = 0

    def export_weights(self, bucket_bytes: int = 64 << 20):
        for i in range(NUM_WEIGHTS):
            parts = [torch.empty(SHARD) for _ in range(self.world)]
            dist.all_gather(parts, shard(self.rank, i), group=self.group)
            yield [(f"w{i}", torch.cat(parts))]

    def train_step(self, batch):
        """A collective too: proves the ranks are still in step after an export."""
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total, group=self.group)
        self.steps += 1
        return {"rank_sum": float(total), "steps": float(self.steps)}

    def forward_logprobs(self, batch):
        raise NotImplementedError

    def save(self, directory: str) -> None:
        pass

    def load(self, directory: str) -> None:
        pass


@hookimpl
def relax_register_trainers(register):
    register("gather_test", GatherTrainer, config=GatherParams)
