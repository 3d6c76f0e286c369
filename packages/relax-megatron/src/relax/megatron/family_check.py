"""What ``relax validate`` says about the model before a megatron run starts: whether its family's model adapter
declares a megatron layout, and whether this trainer runs that layout (not GLM-5's sparse-attention indexer).
Read from the checkpoint's ``config.json`` only: no weights, no megatron import."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def family_problems(model_path: str | None) -> list[str]:
    """Messages naming ``model.path``'s family and why this trainer cannot run it (empty: it can, or the path is
    not a local checkpoint directory, which the run itself checks)."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return []
    from relax.core.model_family import megatron_layout
    from relax.core.multimodal_model import adapter_for, model_config

    config = model_config(model_path)
    adapter = adapter_for(config.model_type)
    if adapter is not None:  # a media model: its language model runs in megatron (media_front.py)
        media = getattr(adapter, "megatron_media", None)
        if media is None or media(config) is None:
            return [
                f"model.path: model_type {config.model_type!r}: its model adapter declares no megatron media front "
                "(ModelAdapter.megatron_media); use trainer.backend: torch or fsdp for this model"
            ]
        config = adapter.megatron_lm_config(config)
    try:
        layout = megatron_layout(config)
    except ValueError as e:
        return [f"model.path: {e}"]
    return _layout_problems(layout, config.model_type)


def _layout_problems(layout: Any, model_type: str) -> list[str]:
    if layout.attention == "sparse":
        return [
            f"model.path: model_type {model_type!r} uses multi-latent attention with a sparse-attention indexer, "
            "which the megatron trainer does not run yet (megatron-core 0.16.1's DSA attention needs Transformer "
            "Engine kernels); use trainer.backend: torch or fsdp for this model"
        ]
    return []
