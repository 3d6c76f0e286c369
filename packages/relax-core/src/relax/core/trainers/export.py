"""Weight export helpers every trainer backend shares: buckets for a transport, the engines' dtype."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating weight in ``dtype`` (the tensor itself when it already is); other tensors unchanged."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group ``(name, tensor)`` pairs into lists of about ``bucket_bytes`` (a bucket exceeds it only
    for one big tensor): a weight sync moves one bucket at a time, never the whole model."""
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
