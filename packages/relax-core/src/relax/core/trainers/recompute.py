"""Activation recompute for HF models: each repeated block (decoder layer, vision / audio block) keeps
only its inputs in forward and runs again in backward, trading one extra forward for the block's
activations (``trainer.recompute: full``). Megatron offers ``selective`` too (attention only); an HF
backend refuses it by name rather than silently doing something else."""

from __future__ import annotations

import torch

from relax.core.trainers.fsdp.sharding import checkpoint_forward, repeated_blocks


def recompute_problem(mode: str) -> str | None:
    """Why an HF-model backend (torch, fsdp) cannot take ``trainer.recompute: mode`` (None when it can);
    checked by ``relax validate`` and again at start-up."""
    if mode in ("off", "full"):
        return None
    return f"trainer.recompute: {mode!r} is megatron's; HF-model backends (torch, fsdp) offer off | full"


def recompute_blocks(model: torch.nn.Module, mode: str) -> list[torch.nn.Module]:
    """Wrap ``model``'s repeated blocks for ``mode`` (``off`` / ``full``); the blocks wrapped."""
    if mode == "off":
        return []
    if problem := recompute_problem(mode):
        raise ValueError(problem)
    blocks = repeated_blocks(model)
    for block in blocks:
        checkpoint_forward(block)
    return blocks
