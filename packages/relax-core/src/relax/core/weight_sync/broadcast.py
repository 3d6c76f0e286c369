"""torch.distributed broadcast transport (gloo on CPU, NCCL on GPU) and the engine-side mixin.

The process that calls ``sync`` is rank 0 of a private process group (its own TCPStore; the
default group, which a trainer may use for DDP, is never touched); engine actor ``i`` is rank
``i + 1``. Per trainer bucket: tensors are packed into one flat byte buffer, engines get the layout
by an actor call (``receive_broadcast``) and the bytes by broadcasts of fixed-size chunks
(``bucket_bytes``). Every collective waits at most ``timeout_s``; after any failure the group is
dropped and rebuilt on the next sync.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from relax.core.weight_sync.base import (
    WeightSyncError,
    bucket_nbytes,
    describe_error,
    engine_names,
    is_actor,
    iter_buckets,
    start,
    stats,
    verify_versions,
    wait_all,
)
from relax.core.weight_sync.flat import chunks, pack, unpack

BLAME_GRACE_S = 3.0  # how long a failed collective waits for engines to report before naming culprits


def new_group(backend: str, store: Any, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group outside torch's global registry; blocks until every rank joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown broadcast backend {backend!r}; use 'gloo' or 'nccl'")


def broadcast_chunk(group: Any, chunk: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([chunk], opts).wait(datetime.timedelta(seconds=timeout_s))


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class BroadcastReceiver:
    """Engine-side mixin for :class:`BroadcastSync`; the engine provides ``update_weights(named, version)``
    and ``weight_version()``. Runs in a (threaded or plain) Ray actor: the calls block on collectives."""

    _relax_group: Any = None

    def init_group(
        self,
        master_addr: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        group_name: str = "",
    ) -> int:
        self.destroy_group()
        store = dist.TCPStore(
            master_addr, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self._relax_group = (
            new_group(backend, store, rank, world_size, timeout_s),
            store,
            backend,
            timeout_s,
            group_name,
        )
        return rank

    def receive_broadcast(self, meta: dict[str, Any], version: int) -> int:
        if self._relax_group is None:
            raise RuntimeError("receive_broadcast before init_group")
        group, _, backend, timeout_s, group_name = self._relax_group
        if meta.get("group_name", "") != group_name:  # another sender re-initialised this engine's group
            raise RuntimeError(
                f"receive_broadcast for group {meta.get('group_name')!r}, but this engine joined {group_name!r}"
            )
        flat = torch.empty(meta["total"], dtype=torch.uint8, device=_device(backend))
        for chunk in chunks(flat, meta["chunk_bytes"]):
            broadcast_chunk(group, chunk, timeout_s)
        self.update_weights(unpack(flat, meta["layout"]), version)
        return self.weight_version()

    def destroy_group(self) -> None:
        self._relax_group = None


class BroadcastSync:
    """Trainer → engines over a torch.distributed broadcast; engines must be Ray actors that mix in
    :class:`BroadcastReceiver`. ``master_addr`` defaults to this node's IP."""

    def __init__(
        self,
        timeout_s: float = 60.0,
        bucket_bytes: int = 64 << 20,
        backend: str = "gloo",
        master_addr: str | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown broadcast backend {backend!r}; use 'gloo' or 'nccl'")
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.master_addr = master_addr
        self._group: Any = None
        self._store: Any = None
        self._members: tuple = ()
        self._name = ""

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        if not all(is_actor(e) for e in engines):
            raise TypeError(
                "the broadcast transport needs engines that are Ray actors (mixing in BroadcastReceiver)"
            )
        t0 = time.perf_counter()
        names = engine_names(engines)
        nbytes = buckets = 0
        try:
            self._ensure_group(engines, names)
            for bucket in iter_buckets(trainer, self.bucket_bytes, self.timeout_s):
                what = f"receive_broadcast(bucket {buckets}, version {version})"
                flat, layout = pack(bucket)
                meta = {
                    "layout": layout,
                    "total": flat.numel(),
                    "chunk_bytes": self.bucket_bytes,
                    "group_name": self._name,
                }
                pending = {
                    n: start(e, "receive_broadcast", meta, version)
                    for n, e in zip(names, engines, strict=True)
                }
                self._send(flat.to(_device(self.backend)), pending, what)
                wait_all(pending, self.timeout_s, what)
                nbytes += bucket_nbytes(bucket)
                buckets += 1
            verify_versions(engines, names, version, self.timeout_s)
        except BaseException:
            self._drop_group()  # a failed collective leaves the group unusable
            raise
        return stats(t0, nbytes, buckets, len(engines))

    def _ensure_group(self, engines: list[Any], names: list[str]) -> None:
        members = tuple(e._actor_id.hex() for e in engines)
        if self._group is not None and members == self._members:
            return
        self._drop_group()
        import ray

        addr = self.master_addr or ray.util.get_node_ip_address()
        world = len(engines) + 1
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(addr, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        name = f"relax-weights-{uuid.uuid4().hex[:12]}"
        pending = {
            n: start(e, "init_group", addr, store.port, rank, world, self.backend, self.timeout_s, name)
            for rank, (n, e) in enumerate(zip(names, engines, strict=True), start=1)
        }
        try:
            group = new_group(self.backend, store, 0, world, self.timeout_s)
        except Exception as exc:
            self._blame(pending, "init_group", exc)
        wait_all(pending, self.timeout_s, "init_group")
        self._group, self._store, self._members, self._name = group, store, members, name

    def _send(self, flat: torch.Tensor, pending: dict, what: str) -> None:
        for chunk in chunks(flat, self.bucket_bytes):
            try:
                broadcast_chunk(self._group, chunk, self.timeout_s)
            except Exception as exc:
                self._blame(pending, what, exc)

    def _blame(self, pending: dict[str, cf.Future], what: str, exc: BaseException) -> None:
        """Turn a failed collective into an error naming the engine(s) at fault. Peers of a stuck or
        dead engine time out too, so blame goes to engines that died, else to those still stuck."""
        import ray.exceptions

        cf.wait(pending.values(), timeout=min(self.timeout_s, BLAME_GRACE_S))
        died = [
            n
            for n, f in pending.items()
            if f.done() and isinstance(f.exception(), ray.exceptions.RayActorError)
        ]
        stuck = [n for n, f in pending.items() if not f.done()]
        failed = [
            f"{n} ({describe_error(f.exception())})" for n, f in pending.items() if f.done() and f.exception()
        ]
        if died:
            culprit = f"{', '.join(died)} died during {what}"
        elif stuck:
            culprit = f"{', '.join(stuck)} did not finish {what} within {self.timeout_s:g}s"
        else:
            culprit = f"{what} failed on {', '.join(failed) or 'no engine'}"
        raise WeightSyncError(f"{culprit}; collective failed ({describe_error(exc)})") from exc

    def _drop_group(self) -> None:
        self._group, self._store, self._members = None, None, ()
