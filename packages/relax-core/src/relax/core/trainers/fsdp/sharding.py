"""How an HF model is split by FSDP2: one shard group per repeated block, then the rest at the root.

Any HF model is a few ``nn.ModuleList``s of identical blocks (decoder layers, vision blocks, audio
layers, MoE layers) plus small leftovers (embeddings, norms, mergers, the head). Each block becomes
its own ``fully_shard`` unit, so only one block is ever gathered at a time; the root unit holds the
leftovers (tied embedding and head stay together there). Nothing here is model-family specific.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def device_mesh(device_type: str, world_size: int, replicate: int) -> Any:
    """1-D ``(shard,)`` mesh, or 2-D ``(replicate, shard)`` for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard")
    )


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every ``ModuleList`` whose entries share one class (decoder layers, vision
    blocks, audio layers), outermost lists only, in module order."""
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > 1
            and len({type(m) for m in module}) == 1
        ):
            blocks.extend(module)
            inside.update(id(m) for block in module for m in block.modules())
    return blocks


def checkpoint_forward(block: torch.nn.Module) -> None:
    """Recompute ``block`` in backward instead of keeping its activations (non-reentrant, so keyword
    arguments and FSDP's hooks around the block work as without it). Names are unchanged."""
    forward: Callable = block.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


def shard_model(
    model: torch.nn.Module,
    mesh: Any,
    compute_dtype: torch.dtype | None,
    *,
    replicated: set[torch.nn.Parameter],
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
) -> list[Any]:
    """``fully_shard`` each repeated block, then the root. The parameters stay fp32 (the master
    copy); FSDP2 casts the gathered copy to ``compute_dtype`` for forward/backward and reduces
    gradients in fp32. Gradients are summed over ranks, not averaged: core's loop already divides
    by the step-global token count. Returns the FSDP units (the root last).

    ``compute_dtype`` None: each parameter is gathered in its own dtype (LoRA: the frozen base is
    already in the compute dtype, the fp32 adapters stay fp32, as on the torch trainer). FSDP2 takes
    mixed dtypes and mixed ``requires_grad`` in one unit as long as the trainable ones share a dtype.

    ``replicated`` parameters (the media towers) are left out: a sharded unit's forward is a
    collective every rank must join, but only the ranks whose rows carry an image run the vision
    tower. Their gradients are summed by the trainer (``finish_gradients``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    options = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
        "ignored_params": replicated,
    }
    units = []
    for block in repeated_blocks(model):
        if all(p in replicated for p in block.parameters()):
            continue
        if activation_checkpointing:
            checkpoint_forward(block)
        units.append(fully_shard(block, reshard_after_forward=reshard_after_forward, **options))
    units.append(fully_shard(model, reshard_after_forward=False, **options))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    return units
