"""The layout of the run's trainer and engine: a plugin backend's own ``memory_layout(cfg)``
(``relax.core.memory_plan.layout.DeclaresLayout``), or, for core's backends (torch, fsdp, hf), the ones here."""

from __future__ import annotations

from typing import Any

from relax.core.memory_plan.layout import (
    DTYPE_BYTES,
    EngineLayout,
    TrainLayout,
    layout_of,
    replicated,
    sharded,
)


def _on_gpu(params: Any) -> bool:
    return str(getattr(params, "device", "cpu")).startswith("cuda")


def trainer_layout(cfg: Any) -> TrainLayout | str | None:
    """None: the trainer runs on CPU; a string: why there is no plan for it."""
    params, backend = cfg.trainer.backend_params, cfg.trainer.backend
    dtype = getattr(params, "dtype", None) or cfg.model.dtype
    if backend == "torch":  # fp32 parameters, autocast forwards in the compute dtype, SDPA attention
        return (
            replicated(params.world_size, dtype, autocast=True, note=f"torch DP {params.world_size}, {dtype}")
            if _on_gpu(params)
            else None
        )
    if backend == "fsdp":
        if not _on_gpu(params):
            return None
        cp = params.context_parallel
        note = (
            f"fsdp {params.world_size} shards"
            + (f", Ulysses CP {cp} x DP {params.world_size // cp}" if cp > 1 else "")
            + f", {dtype}"
        )
        return sharded(params.world_size, dtype, context_parallel=cp, offload=params.cpu_offload, note=note)
    return layout_of(params, cfg)


def engine_layout(cfg: Any, row: int) -> EngineLayout | str | None:
    params = cfg.rollout.engine_params
    if cfg.rollout.engine == "hf":  # one GPU: the weights and the KV cache of a full batch of rows
        if not _on_gpu(params):
            return None
        dtype = cfg.model.dtype
        return EngineLayout(
            gpus=1,
            weight_bytes=DTYPE_BYTES.get(dtype, 4),
            kv_tokens=params.max_batch_size * row,
            runtime_gib=1.5,
            releases_memory=cfg.rollout.release_memory,
        )
    return layout_of(params, cfg)


def recompute(cfg: Any) -> str:
    """The recompute mode the trainer runs (FSDP's older ``activation_checkpointing`` counts as full)."""
    if cfg.trainer.backend == "fsdp" and getattr(
        cfg.trainer.backend_params, "activation_checkpointing", False
    ):
        return "full"
    return cfg.trainer.recompute
