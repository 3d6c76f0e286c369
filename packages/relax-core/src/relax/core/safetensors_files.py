"""Reading and writing an HF checkpoint's ``*.safetensors`` one tensor (or a run of rows) at a time.

A trainer rank that owns a slice of the model must not hold the whole checkpoint to get it. Reading goes
through plain file reads at the offsets the safetensors header gives (not ``mmap``: a mapped page a rank
touched stays in its resident set until the file is closed, so a rank reading half of a mapped file
would still count most of it). Writing streams: each tensor is appended to the current shard file as it
arrives, so the writer holds one tensor, never the state dict. The format is the public one
(https://huggingface.co/docs/safetensors): 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie: ``file``, absolute byte offset ``begin``, dtype and shape."""

    file: Path
    begin: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, Entry]:
    """The tensors of one ``.safetensors`` file (its header only is read)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which Relax does not read")
        entries[name] = Entry(
            file, 8 + size + info["data_offsets"][0], DTYPES[info["dtype"]], tuple(info["shape"])
        )
    return entries


class Checkpoint:
    """The tensors of an HF directory's ``*.safetensors`` files, by name; reads copy only what is asked."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {model_dir}: Relax loads HF safetensors checkpoints"
            )
        self.entries: dict[str, Entry] = {}
        for file in files:
            self.entries.update(read_header(file))

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or rows ``[start, stop)`` of its first dimension (contiguous bytes: only those are read)."""
        e = self.entries[name]
        start, stop = rows if rows is not None else (0, e.shape[0] if e.shape else 1)
        out = torch.empty((stop - start, *e.shape[1:]) if e.shape else (), dtype=e.dtype)
        return self._read_into(name, out, start)

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Rows ``[start, stop)`` (all by default) of ``name`` copied into ``out`` of their shape; straight from
        the file into ``out``'s memory when it is a contiguous host tensor of the file's dtype (no second copy)."""
        e = self.entries[name]
        start = rows[0] if rows is not None else 0
        if out.device.type == "cpu" and out.dtype == e.dtype and out.is_contiguous():
            self._read_into(name, out, start)
        else:
            out.copy_(self.read(name, rows))

    def _read_into(self, name: str, out: torch.Tensor, start: int) -> torch.Tensor:
        e = self.entries[name]
        row = 1
        for n in e.shape[1:]:
            row *= n
        if out.numel():
            with open(e.file, "rb", buffering=0) as f:
                f.seek(e.begin + start * row * out.element_size())
                buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
                if f.readinto(buffer) != len(buffer):
                    raise ValueError(f"{e.file}: tensor {name!r} is truncated")
        return out


class ShardWriter:
    """Writes ``model-0000i-of-0000n.safetensors`` files tensor by tensor (a new file once ``max_bytes`` would
    be passed) and, at :meth:`close`, the index ``save_pretrained`` writes. Each file's header is written
    last (its size is known once the file is full): the file starts with room reserved for it."""

    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int = 5 << 30, header_room: int = 1 << 20
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.header_room = max_bytes, header_room
        self.files: list[tuple[Path, dict[str, dict]]] = []
        self._f = None
        self._size = 0

    def _open(self) -> None:
        self._finish()
        path = self.directory / f".shard-{len(self.files)}.tmp"
        self._f = open(path, "wb")
        self._f.write(b"\0" * (8 + self.header_room))
        self.files.append((path, {}))
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        full = self._size and self._size + size > self.max_bytes
        if self._f is None or full or len(json.dumps(self.files[-1][1])) > self.header_room // 2:
            self._open()
        offsets = [self._size, self._size + size]
        self.files[-1][1][name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": offsets}
        if size:
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._size += size

    def _finish(self) -> None:
        """Put the header in front of the data: the reserved room becomes the header, padded with spaces
        (JSON whitespace; the format allows it), so no byte of data moves."""
        if self._f is None:
            return
        path, header = self.files[-1]
        text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
        if len(text) > self.header_room:
            raise ValueError(f"{path}: the header ({len(text)} bytes) outgrew its reserved room")
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self.header_room) + text.ljust(self.header_room))
        self._f.close()
        self._f = None

    def close(self) -> list[str]:
        """Name the files as ``save_pretrained`` does (one ``model.safetensors``, or numbered with an index)."""
        self._finish()
        count = len(self.files)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map = {}
        total = 0
        for (path, header), name in zip(self.files, names, strict=True):
            os.replace(path, self.directory / name)
            for tensor, info in header.items():
                weight_map[tensor] = name
                total += info["data_offsets"][1] - info["data_offsets"][0]
        if count > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def write_streamed(
    directory: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int = 5 << 30
) -> list[str]:
    """Every ``(name, tensor)`` into safetensors shards under ``directory``, one tensor held at a time."""
    writer = ShardWriter(directory, max_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    return writer.close()
