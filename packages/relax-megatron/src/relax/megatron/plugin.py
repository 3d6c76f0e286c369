"""Entry point of relax-megatron: registers the ``megatron`` trainer with relax-core."""
