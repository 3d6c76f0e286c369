"""Process-group set-up for megatron-core on this rank (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import torch


def ensure_process_group(
    rank: int = 0, world_size: int = 1, master_addr: str | None = None, master_port: int | None = None,
    timeout_s: float = 120.0,
) -> None:
    """Join (or reuse) the default process group: NCCL when a GPU is present, else gloo.

    A world of one without a rendezvous address uses a local file store. An existing group of another
    size is an error.
    """
    import datetime
    import tempfile

    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"torch.distributed is already initialised with world size "
                               f"{dist.get_world_size()}, not {world_size}")  # fmt: skip
        return
    if master_addr is None or master_port is None:
        if world_size != 1:
            raise ValueError(f"world_size={world_size} needs master_addr and master_port")
        init = f"file://{tempfile.mkdtemp(prefix='relax-megatron-')}/store"
    else:
        init = f"tcp://{master_addr}:{master_port}"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def initialize_model_parallel(
    tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0, expert_parallel: int = 1
) -> None:
    """Initialise megatron's parallel state and its RNG tracker over an already initialised
    ``torch.distributed`` default group; applies the CPU patches when no GPU is present.

    Idempotent for the same sizes; a different layout while one is active is an error, not a silent reuse.
    """
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp
    from relax.megatron.cpu_compat import ensure_cpu_compat

    if not torch.distributed.is_initialized():
        raise RuntimeError("initialise torch.distributed (gloo on CPU, nccl on GPU) before megatron's parallel state")
    ensure_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())  # fmt: skip
        if have != (tensor_parallel, pipeline_parallel, expert_parallel):
            raise RuntimeError(f"megatron parallel state is already initialised with (TP, PP, EP)={have}")
    else:
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel,
                                                 expert_model_parallel_size=expert_parallel)  # fmt: skip
    mtp.model_parallel_cuda_manual_seed(seed)


def gather_tp_shards(local: dict[str, torch.Tensor], tp: int, group=None) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's tensors (same names on every rank), in rank order; TP=1 returns ``[local]``."""
    if tp == 1:
        return [local]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return shards
