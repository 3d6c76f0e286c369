"""``trainer.backend: fsdp`` -- any HF model (text, VL, Omni, MoE) sharded with PyTorch FSDP2:
parameters, gradients and optimizer state split across the trainer's ranks, bf16 compute over fp32
master weights. A backend of core's policy-update loop (``relax.core.policy_update``)."""

from relax.core.trainers.fsdp.params import FSDPParams

__all__ = ["FSDPParams"]
