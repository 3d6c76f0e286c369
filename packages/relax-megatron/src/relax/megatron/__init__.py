"""Relax trainer backend on megatron-core (registered as ``trainer.backend: megatron``)."""

from relax.megatron.layer_specs import megatron_core_version

__all__ = ["megatron_core_version"]
