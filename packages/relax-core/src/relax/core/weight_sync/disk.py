"""Disk transport: the trainer writes safetensors shards into a per-version directory, engines load it.

Layout: ``<directory>/v00000042/model-00000.safetensors, ...`` plus ``model.safetensors.index.json``
(HF style ``weight_map``), one shard per bucket. A version directory appears atomically (written under
a temporary name, then renamed), so an engine never reads a half-written version. Engines on other
nodes need ``directory`` on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from relax.core.protocols import NamedTensors
from relax.core.weight_sync.base import WeightSyncError, bucket_nbytes
from relax.core.weight_sync.transport import Peers, Receiver, Transport

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class DiskParams:
    """``weight_sync.params`` of ``disk``."""

    directory: str | None = None  # None: a fresh temporary directory on the trainer's node
    keep: int = 2  # newest version directories kept

    def validate(self) -> list[str]:
        return [] if self.keep >= 1 else [f"keep: must be >= 1, got {self.keep}"]


def write_weights(buckets: Iterable[NamedTensors], path: Path, version: int) -> Iterator[int]:
    """Write one shard per bucket under ``path`` (atomically, once all are written); yields bytes per shard."""
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
        yield bucket_nbytes(bucket)
    index = {"metadata": {"total_size": nbytes, "relax_version": version}, "weight_map": weight_map}
    (tmp / INDEX).write_text(json.dumps(index))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def read_weights(path: str | os.PathLike) -> Iterator[NamedTensors]:
    """One list of (name, tensor) per shard, in the order the names were written."""
    weight_map: dict[str, str] = json.loads((Path(path) / INDEX).read_text())["weight_map"]
    for fname in dict.fromkeys(weight_map.values()):
        shard = load_file(Path(path) / fname)
        yield [(name, shard[name]) for name, f in weight_map.items() if f == fname]


PROBE = ".relax-visible"


def sees_directory(probe: str, token: str) -> bool:
    """Whether this process's node sees the sender's directory: the probe file holds ``token``; else a
    ``WeightSyncError`` saying the directory must be shared (any receiver of a disk-based transport)."""
    try:
        if Path(probe).read_text() == token:
            return True
    except OSError:
        pass
    raise WeightSyncError(
        f"weight_sync.params.directory {Path(probe).parent} is not visible from this engine's node "
        f"({_node_ip()}): the disk transport needs a directory that the trainer's and every engine's node "
        "see (a shared filesystem); set weight_sync.params.directory, or use object_store or broadcast"
    )


class DiskReceiver(Receiver):
    def load(self, path: str, version: int) -> None:
        for named in read_weights(path):
            self.engine.update_weights(named, version)

    def sees(self, probe: str, token: str) -> bool:
        """Whether this engine's node sees the sender's directory (the probe file with its token)."""
        return sees_directory(probe, token)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "this machine"


class DiskSync(Transport):
    """Trainer writes a version directory; every engine loads it shard by shard."""

    name = "disk"
    config = DiskParams
    receiver_cls = DiskReceiver
    reach = "shared_path"  # every engine checks it sees the directory (a probe file) before loading

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self._tmpdir: str | None = None
        self._seen: set[str] = set()  # engines that saw the directory's probe

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        if self.params.directory is None and self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="relax-weights-")  # in the trainer's process
        root = Path(self.params.directory or self._tmpdir)
        self._check_visible(root, peers)
        path = root / f"v{version:08d}"
        yield from write_weights(trainer.export_weights(self.bucket_bytes), path, version)
        peers.call("load", str(path), version, what=f"load({path})")
        versions = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.params.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _check_visible(self, root: Path, peers: Peers) -> None:
        """New engines (e.g. on another node) must see ``root``: a probe file written here, read there."""
        new = [name for name in peers.names if name not in self._seen]
        if not new:
            return
        root.mkdir(parents=True, exist_ok=True)
        probe = root / PROBE
        probe.write_text(self.uid)
        try:
            peers.call("sees", str(probe), self.uid, what=f"check that {root} is visible")
        finally:
            probe.unlink(missing_ok=True)  # the directory holds only version directories
        self._seen.update(new)

    def close(self) -> None:
        """Remove the temporary directory this sender made (a configured ``directory`` is kept)."""
        super().close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
