"""Relax trainer backend on megatron-core (registered as ``trainer.backend: megatron``)."""
