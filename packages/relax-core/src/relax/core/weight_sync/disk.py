"""Disk transport: safetensors shards in a per-version directory, loaded by each engine.

Layout: ``<directory>/v00000042/model-00000.safetensors, ...`` plus ``model.safetensors.index.json``
(HF style ``weight_map``). A version directory appears atomically (written under a temporary name,
then renamed), so an engine never reads a half-written version. Engines on other nodes need
``directory`` on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from relax.core.weight_sync.base import (
    NamedTensors,
    bucket_nbytes,
    call_all,
    engine_names,
    iter_buckets,
    stats,
    verify_versions,
)

INDEX = "model.safetensors.index.json"


def write_weights(buckets: Iterator[NamedTensors], path: Path, version: int) -> tuple[int, int]:
    """Write one shard per bucket under ``path`` (atomically); returns (bytes, shards)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    nbytes = shards = 0
    for bucket in buckets:
        fname = f"model-{shards:05d}.safetensors"
        tensors, seen = {}, set()
        for name, t in bucket:
            t = t.detach().cpu().contiguous()
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = (
                t.clone() if ptr in seen and t.numel() else t
            )  # safetensors refuses shared storage
            seen.add(ptr)
            weight_map[name] = fname
        save_file(tensors, tmp / fname, metadata={"relax_version": str(version)})
        nbytes += bucket_nbytes(bucket)
        shards += 1
    index = {"metadata": {"total_size": nbytes, "relax_version": version}, "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return nbytes, shards


def read_weights(path: str | os.PathLike) -> Iterator[NamedTensors]:
    """One list of (name, tensor) per shard, in the order the names were written."""
    weight_map: dict[str, str] = json.loads((Path(path) / INDEX).read_text())["weight_map"]
    for fname in dict.fromkeys(weight_map.values()):
        shard = load_file(Path(path) / fname)
        yield [(name, shard[name]) for name, f in weight_map.items() if f == fname]


class DiskReceiver:
    """Engine-side mixin for :class:`DiskSync`; the engine provides ``update_weights`` and ``weight_version``."""

    def load_weights_from_disk(self, path: str, version: int) -> int:
        for named in read_weights(path):
            self.update_weights(named, version)
        return self.weight_version()


class DiskSync:
    """Trainer writes a version directory; every engine loads it (``load_weights_from_disk``).
    Keeps the newest ``keep`` version directories."""

    def __init__(
        self,
        timeout_s: float = 60.0,
        bucket_bytes: int = 1 << 30,
        directory: str | None = None,
        keep: int = 2,
    ):
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.directory = Path(directory) if directory else None  # default: a temp dir, made on first sync
        self.keep = max(1, keep)

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        names = engine_names(engines)
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="relax-weights-"))
        path = self.directory / f"v{version:08d}"
        nbytes, shards = write_weights(
            iter_buckets(trainer, self.bucket_bytes, self.timeout_s), path, version
        )
        call_all(
            engines,
            names,
            "load_weights_from_disk",
            (str(path), version),
            self.timeout_s,
            f"load_weights_from_disk({path})",
        )
        verify_versions(engines, names, version, self.timeout_s)
        self._prune()
        return stats(t0, nbytes, shards, len(engines))

    def _prune(self) -> None:
        versions = sorted(p for p in self.directory.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
