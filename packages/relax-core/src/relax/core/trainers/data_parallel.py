"""Data parallelism for the torch trainer: a private process group over the trainer's ranks (and the sums a
replicated module needs over the fsdp trainer's default group, :class:`DefaultGroupSums`).

Every rank holds a full model copy and takes a contiguous share of whole rows of each mini-batch.
Token / sequence counts, gradients and metric sums are summed across ranks, so the update equals
the single-process one on the same batch (up to float summation order).

The group is built from its own store and never registered as torch's default group: a weight-sync
transport may create its own groups in the same process without clashing. Rank 0 hosts the store
on ``master_addr`` only (loopback on one node), never on every interface.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relax.core.policy_update.batching import shard_bounds


def _local_address(master_addr: str) -> str:
    """The address this process uses to reach ``master_addr`` (loopback stays loopback)."""
    if master_addr in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))  # UDP: no packet is sent, only the route is chosen
        return s.getsockname()[0]


class DataParallel:
    """Rank ``rank`` of ``world_size``; ``backend`` ``gloo`` (CPU tensors) or ``nccl`` (CUDA).

    Construction blocks until every rank has joined (or ``timeout_s`` passes); every collective
    waits at most ``timeout_s`` for the slowest rank.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._listener = None
        if rank == 0:  # bind the store to master_addr only: TCPStore alone would listen on every interface
            self._listener = socket.socket()
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((master_addr, master_port))
            self._listener.listen(128)
            listen_fd = self._listener.detach()  # the store owns the socket from here on
        self.store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=self.timeout,
            **({"master_listen_fd": listen_fd} if rank == 0 else {}),
        )
        store = dist.PrefixStore("relax-trainer-dp", self.store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(master_addr))]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, opts)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unknown data-parallel backend {backend!r}; use 'gloo' or 'nccl'")
        self.barrier()

    # ------------------------------------------------------------------ collectives
    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (``tensor`` on any device; copied through the group's device)."""
        buf = tensor if tensor.device == self.device else tensor.to(self.device)
        self.group.allreduce([buf]).wait(self.timeout)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a list of floats (one collective), in fp64."""
        return self.all_reduce_(torch.tensor(values, dtype=torch.float64)).tolist()

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every ``p.grad`` over ranks (one flat buffer per dtype)."""
        sum_grads(params, self.all_reduce_)

    def gather_rows(self, local: torch.Tensor, total_rows: int) -> torch.Tensor | None:
        """Concatenate every rank's rows (shards from ``shard_bounds``) on rank 0; None elsewhere."""
        size = max(
            e - s for s, e in (shard_bounds(total_rows, r, self.world_size) for r in range(self.world_size))
        )
        padded = torch.zeros((size, *local.shape[1:]), dtype=local.dtype, device=self.device)
        padded[: local.shape[0]] = local.to(self.device)
        outs = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.group.allgather([outs], [padded]).wait(self.timeout)
        if self.rank != 0:
            return None
        parts = []
        for r, out in enumerate(outs):
            s, e = shard_bounds(total_rows, r, self.world_size)
            parts.append(out[: e - s])
        return torch.cat(parts).cpu()

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1))

    def close(self) -> None:
        self.group = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def sum_grads(params: list[torch.nn.Parameter], all_reduce_: Callable[[torch.Tensor], Any]) -> None:
    """Sum every ``p.grad`` over ranks with ``all_reduce_`` (in place), one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class DefaultGroupSums:
    """Sums over torch's default process group (the fsdp trainer's ranks), or over ``group`` (its data-parallel
    ranks under context parallelism), on ``device`` (the group's: CUDA for NCCL, host for gloo): what a
    replicated module, such as the critic, needs to train data-parallel there."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device, self.group = device, group

    def _all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        buf = tensor if tensor.device == self.device else tensor.to(self.device)
        dist.all_reduce(buf, group=self.group)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce_(torch.tensor(values, dtype=torch.float64)).tolist()

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        sum_grads(params, self._all_reduce_)
