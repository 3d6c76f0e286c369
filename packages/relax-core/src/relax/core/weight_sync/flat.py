"""Byte-level bucket encodings, bit-exact for every dtype.

A bucket's *layout* places each tensor at a 64-byte aligned offset of one virtual flat uint8
buffer. The broadcast transport sends that buffer as *segments*: a large contiguous tensor straight
from its own memory (no staging copy), runs of small tensors packed into a reused staging buffer.
The receiver gets every segment into the same offsets of its one preallocated buffer and hands
views of it (``unpack``) to the engine. ``ZeroCopyBucket``: a bucket that crosses the Ray object
store as raw byte buffers instead of pickled torch tensors (the object-store transport).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from relax.core.protocols import NamedTensors

ALIGN = 64  # byte offset alignment inside a flat buffer, so views keep every dtype aligned
Layout = list[tuple[str, str, tuple[int, ...], int, int]]  # (name, dtype, shape, offset, nbytes)


class Segment(NamedTuple):
    """Bytes ``[start, end)`` of the flat buffer, carrying tensors ``first .. last - 1`` of the layout;
    ``direct``: one tensor sent from its own memory."""

    start: int
    end: int
    first: int
    last: int
    direct: bool


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan(bucket: NamedTensors) -> tuple[Layout, int]:
    """Offsets of each tensor in a flat buffer, and the buffer's size."""
    layout: Layout = []
    offset = 0
    for name, t in bucket:
        n = nbytes_of(t)
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n))
        offset += -(-n // ALIGN) * ALIGN
    return layout, offset


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when contiguous, else one copy)."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(-1).view(torch.uint8)


def pack_into(buffer: torch.Tensor, bucket: NamedTensors, layout: Layout, base: int = 0) -> None:
    """Copy each tensor's bytes to ``buffer[offset - base:]`` (a staging buffer holding a run)."""
    for (_, t), (_, _, _, off, n) in zip(bucket, layout, strict=True):
        if n:
            buffer[off - base : off - base + n].copy_(byte_view(t))


def pack(bucket: NamedTensors) -> tuple[torch.Tensor, Layout]:
    """A bucket in one new uint8 buffer, and its layout."""
    layout, total = plan(bucket)
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    pack_into(flat, bucket, layout)
    return flat, layout


def unpack(flat: torch.Tensor, layout: Layout) -> NamedTensors:
    """Views into ``flat`` with the original dtypes and shapes (bit-identical to what was packed)."""
    return [
        (name, flat[off : off + n].view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, off, n in layout
    ]


def segments(layout: Layout, direct_bytes: int, run_bytes: int) -> list[Segment]:
    """Tensors of at least ``direct_bytes`` become direct segments; consecutive smaller ones are
    grouped into runs of at most ``run_bytes`` (one tensor larger than that is direct anyway)."""
    out: list[Segment] = []
    run_start = None  # index of the first tensor in the open run
    for i, (_, _, _, off, n) in enumerate(layout):
        end = off + n
        if run_start is not None and end - layout[run_start][3] > run_bytes:
            out.append(_run(layout, run_start, i))
            run_start = None
        if n >= direct_bytes or n > run_bytes:
            if run_start is not None:
                out.append(_run(layout, run_start, i))
                run_start = None
            out.append(Segment(off, end, i, i + 1, True))
        elif run_start is None:
            run_start = i
    if run_start is not None:
        out.append(_run(layout, run_start, len(layout)))
    return out


def _run(layout: Layout, first: int, last: int) -> Segment:
    _, _, _, off, n = layout[last - 1]
    return Segment(layout[first][3], off + n, first, last, False)


def chunks(flat: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)]


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
            (name, byte_view(t.cpu()).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
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
