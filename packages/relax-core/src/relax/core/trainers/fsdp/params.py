"""``trainer.backend_params`` of the ``fsdp`` trainer, checked before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from relax.core.trainers.fsdp.layout import layout_problem


@dataclass(frozen=True)
class FSDPParams:
    """``world_size`` ranks (Ray actors) shard the model; ``replicate`` > 1 makes an HSDP mesh of
    ``replicate`` x ``world_size / replicate`` (shards within a group, replicas across groups: one
    group per node on a cluster). ``dtype`` is the compute dtype: the master weights, gradient
    reduction and optimizer state stay fp32 (``param_dtype`` / ``reduce_dtype`` of FSDP2's
    mixed-precision policy), so an update at an RL learning rate is never rounded away.

    ``reshard_after_forward``: free the gathered layer after its forward (less memory, one more
    all-gather in backward). ``activation_checkpointing``: recompute each decoder layer in
    backward. ``cpu_offload``: shards and optimizer state live in host memory (CUDA only).
    ``share_prompts``: a GRPO group's prompt runs once per micro-batch (two forwards per
    micro-batch; off by default under FSDP)."""

    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] | None = None  # None: the run's model.dtype
    world_size: int = 1
    replicate: int = 1
    num_cpus: float = 1.0
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    freeze_media_towers: bool = False  # VL / Omni: keep every media tower as loaded (untrained, unsynced)
    freeze_vision: bool = False  # ... the vision tower only (a model without one is an error)
    freeze_audio: bool = False  # ... the audio tower only (a model without one is an error)
    share_prompts: bool = False
    # Ulysses context parallelism: groups of N consecutive ranks run the same rows, each a 1/N slice of
    # their packed tokens (attention heads all-to-all); world_size / N data-parallel replicas
    # (fsdp/layout.py, docs/long-sequences.md); needs trainer.pack_sequences, N divides world_size
    context_parallel: int = 1

    def validate(self) -> list[str]:
        errors = []
        if self.world_size < 1:
            errors.append(f"world_size: must be >= 1, got {self.world_size}")
        if self.replicate < 1 or self.world_size % max(self.replicate, 1):
            errors.append(f"replicate: must divide world_size ({self.world_size}), got {self.replicate}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            errors.append(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_offload and self.device == "cpu":
            errors.append(
                "cpu_offload: the shards already live in host memory on device 'cpu'; use it with device 'cuda'"
            )
        if problem := layout_problem(self.world_size, self.context_parallel):
            errors.append(problem)
        elif self.context_parallel > 1 and self.replicate > 1:
            errors.append(
                f"context_parallel: {self.context_parallel} with replicate: {self.replicate} (HSDP) is not built; "
                "context parallelism shards over all ranks (world_size / context_parallel data-parallel "
                "replicas): set replicate: 1"
            )
        return errors

    def validate_run(self, cfg: Any) -> list[str]:
        """Against the run: the dtype inherited from ``model.dtype``, and host memory for offload."""
        if self.cpu_offload and cfg.trainer.offload:
            return [
                "trainer.offload with trainer.backend_params.cpu_offload: the shards and optimizer state already "
                "live in host memory; set one of them to false"
            ]
        if cfg.trainer.recompute not in ("off", "full"):  # what the trainer refuses at start-up
            return [
                f"trainer.recompute: {cfg.trainer.recompute!r} is megatron's; the fsdp backend offers off | full"
            ]
        if self.activation_checkpointing and cfg.algorithm.routing_replay != "off":
            return [
                "trainer.backend_params.activation_checkpointing with algorithm.routing_replay: the forward "
                "recomputed in backward would route with the model's own experts; set it to false"
            ]
        if self.context_parallel > 1 and not cfg.trainer.pack_sequences:
            return [
                "trainer.backend_params.context_parallel: splits packed rows over the ranks; set trainer.pack_sequences: true"
            ]
        dtype = self.dtype or cfg.model.dtype
        if problem := dtype_problem(dtype, self.device):
            field = "trainer.backend_params" if self.dtype else "model"
            return [f"{field}.{problem}" + ("" if self.dtype else " (or set trainer.backend_params.dtype)")]
        if self.cpu_offload and cfg.model.path:
            need = (
                16 * model_parameters(cfg.model.path) * self.world_size
            )  # fp32 weights, grads, AdamW: all ranks of this host
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > have:
                return [
                    f"trainer.backend_params.cpu_offload: the offloaded training state needs ~{need / 2**30:.1f} GiB "
                    f"of host memory ({self.world_size} ranks on one host), this machine has {have / 2**30:.1f} GiB"
                ]
        return []


def model_parameters(model_path: str) -> int:
    """Parameters of the model at ``model_path``, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax.core.multimodal_model import model_config

    config = model_config(model_path)  # a whole Qwen-Omni checkpoint: its thinker's, the model trained
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # a media model type: image-text-to-text
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def dtype_problem(dtype: str, device: str) -> str | None:
    """Why ``dtype`` cannot be the compute dtype on ``device`` (None when it can)."""
    if dtype == "float16":
        return (
            "dtype: float16 needs loss scaling, which the fsdp trainer does not do; use bfloat16 "
            "(fp32 master weights and gradient reduction either way)"
        )
    if dtype not in ("float32", "bfloat16"):
        return f"dtype: expected float32 or bfloat16, got {dtype!r}"
    return None
