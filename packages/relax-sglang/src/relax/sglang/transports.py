"""Weight-sync transports into SGLang servers, registered like core's (``weight_sync.transport``).

Each runs inside core's :class:`relax.core.weight_sync.Transport` frame: the trainer's process sends,
each engine's process receives (here: turns the data into SGLang HTTP calls on its server), every call
has a deadline naming the engine, ``begin_weight_update`` / ``end_weight_update`` bracket the update on
every server (``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` are refused
outside it), and after ``end`` each server must report the new ``weight_version``.

- ``sglang_disk``: the trainer writes a safetensors version directory (core's disk layout), every server
  loads it with ``/update_weights_from_disk``. Servers on other nodes need ``directory`` on shared storage.
- ``sglang_tensor``: each bucket goes to the engine's process, which hands it to its server through
  ``/update_weights_from_tensor`` (tensors shared through /dev/shm; same node as the server).
- ``sglang_distributed``: the trainer is rank 0 of a torch.distributed group that every server joins
  (``/init_weights_update_group``; gloo on CPU, NCCL on GPU); per bucket the servers are told the layout
  (``/update_weights_from_distributed``) and the trainer broadcasts each tensor.

Each asks the engines what their servers run first and sends the export in that model's loader layout
(``relax.sglang.served_layout``: a model served whole takes its checkpoint's names). They extend only core's
contract classes (``Transport``, ``Receiver``) and compose core's public pieces: the disk and tensor ones
hand the served export to core's ``disk`` / ``in_process`` transports, the distributed one builds its
group side with core's ``new_group`` on the store prefixes SGLang's servers use.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from relax.core.weight_sync import (
    DiskParams,
    DiskSync,
    InProcessParams,
    InProcessSync,
    Receiver,
    Transport,
    WeightSyncError,
)
from relax.core.weight_sync.base import bucket_nbytes
from relax.core.weight_sync.broadcast import broadcast, listen, nccl_colocate_errors, new_group
from relax.core.weight_sync.disk import sees_directory
from relax.core.weight_sync.transport import Peers
from relax.sglang.served_layout import ServedExport, layout_for

ENGINES = ("sglang",)


class ServedArchitecture:
    """Receiver side of :func:`served_export`."""

    engine: Any

    def served_architecture(self) -> str | None:
        return self.engine.served_architecture


def served_export(trainer: Any, peers: Peers) -> Any:
    """``trainer`` exporting in the layout the engines' servers load (they must agree: one model)."""
    served = set(peers.call("served_architecture", what="served_architecture").values())
    if len(served) > 1:
        raise WeightSyncError(
            f"the engines serve different architectures ({sorted(map(str, served))}): one sync "
            "sends one model"
        )
    architecture = served.pop() if served else None
    return trainer if architecture is None else ServedExport(trainer, layout_for(architecture))


class SGLangReceiver(ServedArchitecture, Receiver):
    pass


class SGLangDiskReceiver(ServedArchitecture, Receiver):
    """Checks, as core's disk receiver does, that this node sees the directory; loads through the server."""

    def sees(self, probe: str, token: str) -> bool:
        return sees_directory(probe, token)

    def load(self, path: str, version: int) -> None:
        self.engine.update_weights_from_disk(path, version)


class SGLangDiskSync(Transport):
    """Trainer writes ``<directory>/v<version>`` (core's disk transport: probe, write, prune); each server
    loads it from disk."""

    name = "sglang_disk"
    config = DiskParams
    receiver_cls = SGLangDiskReceiver
    engines = ENGINES
    reach = DiskSync.reach

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self.disk = DiskSync(self.params, self.ctx)  # its calls reach this transport's receivers

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        return self.disk.send(served_export(trainer, peers), peers, version)

    def close(self) -> None:
        super().close()
        self.disk.close()  # its temporary directory


class SGLangTensorSync(Transport):
    """Each bucket to each engine's process (core's in-process transport), then into its server as
    shared-memory tensors."""

    name = "sglang_tensor"
    config = InProcessParams
    receiver_cls = SGLangReceiver
    engines = ENGINES

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self.direct = InProcessSync(self.params, self.ctx)

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        return self.direct.send(served_export(trainer, peers), peers, version)


@dataclass(frozen=True)
class SGLangDistributedParams:
    """``weight_sync.params`` of ``sglang_distributed``."""

    backend: Literal["gloo", "nccl"] = "gloo"
    master_addr: str = "127.0.0.1"  # where the trainer's store listens; servers on other nodes need its IP

    def validate_run(self, cfg: Any) -> list[str]:
        return nccl_colocate_errors(
            cfg,
            self.backend,
            "use weight_sync.transport sglang_tensor (CUDA IPC on the shared GPU), or mode async / hybrid",
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def group_device(backend: str, cuda_index: int | None = None) -> torch.device:
    """Where the group's tensors must live: NCCL only moves CUDA tensors (the trainer's current GPU), gloo
    only host ones."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device() if cuda_index is None else cuda_index)


def on_group_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` as the broadcast sends it: contiguous, on the group's device. Trainers export on their own
    device, so over NCCL this is no copy; a trainer on another device than the group's (a CPU trainer over
    NCCL, a CUDA trainer over gloo) is moved. A tensor already there is sent as is (no copy)."""
    return tensor.detach().to(device).contiguous()


def open_store(addr: str, world: int, timeout_s: float) -> tuple[Any, int]:
    """The group's TCPStore, listening on ``addr`` only: (store, port)."""
    import torch.distributed as dist

    fd, port = listen(addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(
        addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    ), port


def trainer_group(store: Any, world: int, name: str, backend: str, addr: str, timeout_s: float) -> Any:
    """Rank 0's side of SGLang's ``init_custom_process_group``: core's ``new_group`` on the store prefixes
    torch gives that group's one backend (``<name>`` by SGLang, ``<name>/`` and the device by torch), so the
    servers' ranks meet ours. Blocks until every rank joined; the servers join over HTTP meanwhile."""
    import torch.distributed as dist

    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    group = new_group(backend, prefixed, 0, world, timeout_s, addr)
    if backend == "gloo":  # gloo ranks > 0 wait for rank 0's sequence number (no public call sets it)
        group._set_sequence_number_for_group()
    return group


class SGLangDistributedReceiver(ServedArchitecture, Receiver):
    def tp_size(self) -> int:
        """The ranks this engine adds to the group (every server's TP ranks)."""
        return int(self.engine.weight_update_ranks())

    def join(self, addr: str, port: int, rank_offset: int, world: int, group: str, backend: str) -> None:
        self.engine.init_weights_update_group(addr, port, rank_offset, world, group, backend)
        self.group = group

    def receive(self, layout: list[tuple[str, str, list[int]]], group: str, version: int) -> None:
        self.engine.update_weights_from_distributed(layout, group, version)

    def leave(self, group: str) -> None:
        self.engine.destroy_weights_update_group(group)


class SGLangDistributedSync(Transport):
    """Trainer rank 0 broadcasts each bucket to every server over a torch.distributed group."""

    name = "sglang_distributed"
    config = SGLangDistributedParams
    receiver_cls = SGLangDistributedReceiver
    engines = ENGINES

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self._group: Any = None
        self._store: Any = None
        self._name = ""
        self._members: tuple = ()
        self._peers: Peers | None = None

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        try:
            self._ensure_group(peers)
            device = group_device(self.params.backend)
            for i, bucket in enumerate(served_export(trainer, peers).export_weights(self.bucket_bytes)):
                layout = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in bucket]
                pending = peers.start("receive", layout, self._name, version)
                timeout = datetime.timedelta(seconds=self.timeout_s)
                try:
                    for _, tensor in bucket:
                        broadcast(self._group, on_group_device(tensor, device)).wait(timeout)
                except Exception as exc:
                    peers.wait(pending, f"update_weights_from_distributed(bucket {i}, version {version})")
                    raise WeightSyncError(
                        f"broadcast of bucket {i} (version {version}) failed: {exc}"
                    ) from exc
                peers.wait(pending, f"update_weights_from_distributed(bucket {i}, version {version})")
                yield bucket_nbytes(bucket)
        except BaseException:
            self.close()  # a failed collective leaves the group unusable: rebuilt on the next sync
            raise

    def _ensure_group(self, peers: Peers) -> None:
        members = tuple(id(e) for e in peers.engines)
        if self._group is not None and members == self._members:
            return
        self.close()
        sizes = list(peers.call("tp_size", what="tp_size").values())
        world = 1 + sum(sizes)
        name = f"relax-sglang-{uuid.uuid4().hex[:12]}"
        addr = self.params.master_addr
        store, port = open_store(addr, world, self.timeout_s)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        pending = peers.start_each(
            "join", [(addr, port, off, world, name, self.params.backend) for off in offsets]
        )
        try:
            group = trainer_group(store, world, name, self.params.backend, addr, self.timeout_s)
        except Exception as exc:
            peers.wait(pending, "init_weights_update_group")  # names the engine that failed to join
            raise WeightSyncError(f"the weight-update group {name} did not form: {exc}") from exc
        peers.wait(pending, "init_weights_update_group")
        self._group, self._store, self._name, self._members, self._peers = group, store, name, members, peers

    def close(self) -> None:
        peers, name = self._peers, self._name
        self._group = self._store = self._peers = None  # the group is outside torch's registry: dropped
        self._members, self._name = (), ""
        if peers is not None and name:
            try:
                peers.call("leave", name, what="destroy_weights_update_group")
            except WeightSyncError:
                pass  # a dead server has no group to leave
