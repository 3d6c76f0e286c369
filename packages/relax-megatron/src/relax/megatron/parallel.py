"""Process-group set-up for megatron-core on this rank (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import torch


def initialize_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0) -> None:
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
        have = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tensor_parallel, pipeline_parallel):
            raise RuntimeError(f"megatron parallel state is already initialised with (TP, PP)={have}")
    else:
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    mtp.model_parallel_cuda_manual_seed(seed)
