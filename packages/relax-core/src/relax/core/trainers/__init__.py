"""Built-in trainers (torch, HF transformers models)."""
