"""torch.distributed broadcast transport (gloo on CPU, NCCL on GPU).

The trainer's process is rank 0 of a private process group (its own store; the default group, which
a trainer may use for data parallelism, is never touched); engine actor ``i`` is rank ``i + 1``. One actor
call per sync (``receive``) starts each engine's receive loop; then, per bucket, a header broadcast
carries the bucket's layout and broadcasts of segments carry its bytes (see ``flat.segments``):
large tensors straight from the trainer's memory, small ones packed into a reused staging buffer.
An empty header ends the loop. Each engine receives into one preallocated buffer and applies every
segment while later ones are still arriving. No per-bucket round trip: the sender never waits for
an engine between buckets. Every collective waits at most ``timeout_s``;
after any failure the group is dropped and rebuilt on the next sync.

The store and gloo's sockets listen on 127.0.0.1 when Ray runs on one node, else on each side's own
node address (the trainer's node for the store, or ``master_addr``) — never on every interface.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import pickle
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from relax.core.weight_sync.base import WeightSyncError, bucket_nbytes, describe_error
from relax.core.weight_sync.flat import Segment, byte_view, pack_into, plan, segments, unpack
from relax.core.weight_sync.transport import Peers, Receiver, Transport

BLAME_GRACE_S = 3.0  # how long a failed collective waits for engines to report before naming culprits
DIRECT_BYTES = 1 << 20  # tensors at least this large are broadcast from their own memory
RUN_BYTES = 4 << 20  # small tensors are packed into staging runs of at most this size (two are reused)


@dataclass(frozen=True)
class BroadcastParams:
    """``weight_sync.params`` of ``broadcast``."""

    backend: Literal["gloo", "nccl"] = "gloo"
    master_addr: str | None = None  # the store's address; None: 127.0.0.1 on one machine, else the node IP

    def validate_run(self, cfg: Any) -> list[str]:
        return nccl_colocate_errors(
            cfg, self.backend, "use backend gloo, or mode async / hybrid (own GPUs per role)"
        )


def nccl_colocate_errors(cfg: Any, backend: str, instead: str) -> list[str]:
    """An NCCL weight-sync group in mode ``colocate`` would have two ranks on one GPU: colocate puts trainer rank
    ``i`` and engine ``i`` in one bundle (one device), and NCCL refuses a second rank on a device (an error at the
    first sync, not at start-up). ``instead``: what the transport offers in its place."""
    if backend != "nccl" or cfg.mode != "colocate":
        return []
    return [
        f"weight_sync.params.backend: nccl in mode 'colocate' puts the trainer's rank 0 and engine 0 on one GPU "
        f"(they share a bundle), and NCCL cannot have two ranks of a group on one device; {instead}"
    ]


def default_master_addr() -> str:
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")] if ray.is_initialized() else []
    return ray.util.get_node_ip_address() if len(alive) > 1 else "127.0.0.1"


def listen(addr: str) -> tuple[int, int]:
    """A listening TCP socket bound to ``addr`` only: (file descriptor, port). TCPStore takes the fd."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return sock.detach(), port


def new_group(backend: str, store: Any, rank: int, world: int, timeout_s: float, host: str) -> Any:
    """A process group outside torch's global registry; blocks until every rank joined. Gloo binds
    its sockets to ``host``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise ValueError(f"unknown broadcast backend {backend!r}; use 'gloo' or 'nccl'")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast from rank 0; returns the work to wait on."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def device_of(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def send_header(group: Any, meta: dict | None, device: torch.device, timeout: datetime.timedelta) -> None:
    """The next bucket's layout (``None``: no more buckets) as a length and a pickled byte string."""
    data = b"" if meta is None else pickle.dumps(meta)
    broadcast(group, torch.tensor([len(data)], dtype=torch.int64, device=device)).wait(timeout)
    if data:
        broadcast(group, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)).wait(timeout)


def recv_header(group: Any, device: torch.device, timeout: datetime.timedelta) -> dict | None:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    broadcast(group, size).wait(timeout)
    if not int(size.item()):
        return None
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(group, data).wait(timeout)
    return pickle.loads(data.cpu().numpy().tobytes())


class BroadcastReceiver(Receiver):
    """Engine side: joins the group, receives each bucket into one reused buffer, applies it segment
    by segment through ``engine.update_weights`` (which copies out of the buffer)."""

    group: Any = None
    group_name = ""
    buffer: torch.Tensor | None = None

    def join(self, addr: str, port: int, rank: int, world: int, name: str) -> int:
        import ray

        self.close()
        timeout = datetime.timedelta(seconds=self.transport.timeout_s)
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        host = (
            addr if addr in ("127.0.0.1", "localhost", "::1") else ray.util.get_node_ip_address()
        )  # its own node's
        self.group = new_group(
            self.transport.params.backend, store, rank, world, self.transport.timeout_s, host
        )
        self.store, self.group_name = store, name
        return rank

    def receive(self, group_name: str, version: int) -> int:
        """Receive and apply buckets until the sender's empty header; returns the number of buckets."""
        if self.group is None or group_name != self.group_name:  # another sender rebuilt the group
            raise WeightSyncError(
                f"receive for group {group_name!r}, but this engine joined {self.group_name!r}"
            )
        device = device_of(self.transport.params.backend)
        timeout = datetime.timedelta(seconds=self.transport.timeout_s)
        buckets = 0
        while (meta := recv_header(self.group, device, timeout)) is not None:
            if self.buffer is None or self.buffer.numel() < meta["total"]:
                self.buffer = None  # free the old one first
                self.buffer = torch.empty(meta["total"], dtype=torch.uint8, device=device)
            segs = [Segment(*s) for s in meta["segments"]]
            works = [
                broadcast(self.group, self.buffer[s.start : s.end]) if s.end > s.start else None for s in segs
            ]
            for seg, work in zip(segs, works, strict=True):  # apply each segment while later ones arrive
                if work is not None:
                    work.wait(timeout)
                self.engine.update_weights(unpack(self.buffer, meta["layout"][seg.first : seg.last]), version)
            buckets += 1
        return buckets

    def close(self) -> None:
        self.group = self.store = self.buffer = None
        self.group_name = ""


class BroadcastSync(Transport):
    """Trainer → engines over a torch.distributed broadcast; engines must be Ray actors."""

    name = "broadcast"
    config = BroadcastParams
    receiver_cls = BroadcastReceiver
    actors_only = True

    def __init__(self, params: Any = None, ctx: Any = None, **overrides: Any):
        super().__init__(params, ctx, **overrides)
        self._group: Any = None
        self._store: Any = None
        self._members: tuple = ()
        self._group_name = ""
        self._staging: list[torch.Tensor | None] = [None, None]

    def send(self, trainer: Any, peers: Peers, version: int) -> Iterator[int]:
        try:
            self._ensure_group(peers)
            device = device_of(self.params.backend)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            pending = peers.start("receive", self._group_name, version)
            buckets = 0
            for bucket in trainer.export_weights(self.bucket_bytes):
                layout, total = plan(bucket)
                segs = segments(layout, DIRECT_BYTES, RUN_BYTES)
                meta = {"layout": layout, "total": total, "segments": [tuple(s) for s in segs]}
                try:
                    send_header(self._group, meta, device, timeout)
                    self._broadcast(bucket, layout, segs, device)
                except Exception as exc:
                    self._blame(pending, f"receive(bucket {buckets}, version {version})", exc)
                buckets += 1
                yield bucket_nbytes(bucket)
            try:
                send_header(self._group, None, device, timeout)
            except Exception as exc:
                self._blame(pending, f"receive(end, version {version})", exc)
            received = peers.wait(pending, f"receive(version {version})")
            if set(received.values()) != {buckets}:
                raise WeightSyncError(
                    f"engines received {received} buckets of version {version}, sent {buckets}"
                )
        except BaseException:
            self.close()  # a failed collective leaves the group unusable
            raise

    def _broadcast(self, bucket: list, layout: list, segs: list[Segment], device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        works: list[tuple[Any, torch.Tensor]] = []
        staged: list[Any] = [None, None]  # the work still reading each staging slot
        packed = 0
        for seg in segs:
            if seg.end == seg.start:
                continue
            if seg.direct:
                buf = byte_view(bucket[seg.first][1]).to(device)
            else:
                slot, packed = packed % 2, packed + 1
                if staged[slot] is not None:
                    staged[slot].wait(timeout)
                buf = self._staging_buffer(slot, device)[: seg.end - seg.start]
                pack_into(buf, bucket[seg.first : seg.last], layout[seg.first : seg.last], seg.start)
            work = broadcast(self._group, buf)
            works.append((work, buf))
            if not seg.direct:
                staged[slot] = work
        for work, _ in works:
            work.wait(timeout)

    def _staging_buffer(self, slot: int, device: torch.device) -> torch.Tensor:
        if self._staging[slot] is None:
            self._staging[slot] = torch.empty(RUN_BYTES, dtype=torch.uint8, device=device)
        return self._staging[slot]

    def _ensure_group(self, peers: Peers) -> None:
        members = tuple(e._actor_id.hex() for e in peers.engines)
        if self._group is not None and members == self._members:
            return
        self.close()
        addr = self.params.master_addr or default_master_addr()
        world = len(peers.engines) + 1
        fd, port = listen(addr)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(
            addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
        name = f"relax-weights-{uuid.uuid4().hex[:12]}"
        pending = peers.start_each("join", [(addr, port, rank, world, name) for rank in range(1, world)])
        try:
            group = new_group(self.params.backend, store, 0, world, self.timeout_s, addr)
        except Exception as exc:
            self._blame(pending, "join", exc)
        peers.wait(pending, "join")
        self._group, self._store, self._members, self._group_name = group, store, members, name

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

    def close(self) -> None:
        self._group, self._store, self._members, self._group_name = None, None, (), ""
