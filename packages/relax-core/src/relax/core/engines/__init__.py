"""Built-in rollout engines (CPU-friendly, HF transformers)."""
