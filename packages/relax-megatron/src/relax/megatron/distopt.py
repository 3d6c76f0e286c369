"""megatron's DistributedOptimizer (CUDA only): Adam state and fp32 main weights sharded over the
data-parallel ranks, behind megatron's DDP wrapper (grad buffers, reduce-scatter, param all-gather).

On CPU megatron-core 0.16 refuses it (the DDP wrapper builds, but the optimizer allocates on ``cuda``
and takes only ``torch.cuda.*Tensor`` parameters: TypeError for a CPU torch.FloatTensor), so the
trainer's own path (AdamW, fp32 masters in bf16, gradients all-reduced by hand) runs there.
The objective already divides by step-global token counts, so the wrapper sums gradients over DP
(``calculate_per_token_loss``) instead of averaging them.
"""

from __future__ import annotations

import math
from typing import Any

CPU_REASON = (
    "distributed_optimizer: not supported on CPU; megatron-core 0.16's DistributedOptimizer needs its "
    "DDP wrapper's grad buffers and takes only CUDA parameters (TypeError for a CPU torch.FloatTensor); "
    "set it to false or use device: cuda"
)
#: why ``trainer.offload`` is refused with it (the own optimizer path offloads: trainer.offloaded_parts)
OFFLOAD_REASON = (
    "trainer.offload with trainer.backend_params.distributed_optimizer: megatron's DDP keeps the parameters and "
    "gradients as views into contiguous buffers, and its optimizer keeps the fp32 main weights in its own shards; "
    "moving each tensor to the host would break those views (slime pauses the buffers with torch_memory_saver, "
    "which relax-megatron does not wire); set distributed_optimizer: false or trainer.offload: false"
)


def wrap(
    model: Any,
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    bf16: bool,
) -> tuple[Any, Any]:
    """(DDP-wrapped model, megatron optimizer) for ``model``; its config must have
    ``calculate_per_token_loss=True`` (gradients summed, not averaged, over DP)."""
    ddp = wrap_ddp(model)
    return ddp, optimizer(
        ddp, lr=lr, min_lr=min_lr, weight_decay=weight_decay, betas=betas, eps=eps, bf16=bf16
    )


def wrap_ddp(model: Any) -> Any:
    """``model`` in megatron's DDP (fp32 grad buffers, sharded for the distributed optimizer); runs on
    CPU too (only the optimizer needs CUDA)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if not model.config.calculate_per_token_loss:
        raise ValueError("distributed optimizer: build the model with calculate_per_token_loss=True")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def optimizer(
    ddp: Any,
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    bf16: bool,
) -> Any:
    """megatron's DistributedOptimizer over ``ddp``'s buffers: Adam with fp32 main weights and state."""
    import torch

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=True,
    )
    return get_megatron_optimizer(config, [ddp])


def zero_grads(ddp: Any, optimizer: Any) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)


def reduce_grads(ddp: Any, optimizer: Any) -> float:
    """After the backward passes: reduce-scatter over DP (and megatron's TP / tied-embedding sums), copy
    the gradients to the main params; return the whole model's gradient norm (before clipping)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def apply(optimizer: Any, grad_clip: float) -> None:
    """Clip (``grad_clip`` > 0) and step; the updated weights are gathered back into every rank's model."""
    if grad_clip and grad_clip > 0 and math.isfinite(grad_clip):
        optimizer.clip_grad_norm(grad_clip)
    optimizer.step_with_ready_grads()
