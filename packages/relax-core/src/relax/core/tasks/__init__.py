"""Synthetic tasks generated locally (no downloads), written as ordinary dataset files."""

from relax.core.tasks.arithmetic import arithmetic_rows, write_arithmetic_jsonl

__all__ = ["arithmetic_rows", "write_arithmetic_jsonl"]
