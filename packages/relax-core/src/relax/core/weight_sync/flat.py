"""Byte-level bucket encodings, bit-exact for every dtype.

``pack``/``unpack``: many tensors in one flat uint8 buffer plus a layout (the broadcast transport
sends it as fixed-size chunks). ``ZeroCopyBucket``: a bucket that crosses the Ray object store as
raw byte buffers instead of pickled torch tensors (the object-store transport).
"""

from __future__ import annotations

import warnings

import torch

from relax.core.protocols import NamedTensors

ALIGN = 64  # byte offset alignment inside a flat buffer, so views keep every dtype aligned
Layout = list[tuple[str, str, tuple[int, ...], int, int]]  # (name, dtype, shape, offset, nbytes)


def pack(bucket: NamedTensors) -> tuple[torch.Tensor, Layout]:
    """Copy a bucket into one uint8 buffer; the layout says where each tensor's bytes live."""
    layout: Layout = []
    offset = 0
    for name, t in bucket:
        nbytes = t.numel() * t.element_size()
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, off, nbytes) in zip(bucket, layout, strict=True):
        flat[off : off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, layout


def unpack(flat: torch.Tensor, layout: Layout) -> NamedTensors:
    """Views into ``flat`` with the original dtypes and shapes (bit-identical to what was packed)."""
    return [
        (name, flat[off : off + nbytes].view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, off, nbytes in layout
    ]


def chunks(flat: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)]


def _byte_view(t: torch.Tensor):
    """The tensor's bytes as a numpy uint8 array (no copy for a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class ZeroCopyBucket:
    """A bucket that pickles each tensor as a raw numpy byte buffer, which Ray stores out-of-band
    (one copy into the object store, no torch pickling) and maps zero-copy in the receiving
    process; it unpickles as a plain list of (name, tensor).

    The received tensors are views of the read-only shared buffer: read or copy them, never modify
    them in place."""

    def __init__(self, bucket: NamedTensors):
        self.bucket = bucket

    def __reduce__(self):
        items = [
            (name, _byte_view(t), str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in self.bucket
        ]
        return _rebuild, (items,)


def _rebuild(items: list) -> NamedTensors:
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # "non-writable NumPy array": intended, see ZeroCopyBucket
        return [
            (name, torch.from_numpy(a).view(getattr(torch, dtype)).reshape(shape))
            for name, a, dtype, shape in items
        ]
