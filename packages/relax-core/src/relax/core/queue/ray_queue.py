"""The transfer queue as a shared Ray actor, plus the client every role talks to.

The actor is the plain :class:`TransferQueue` run with many threads (``max_concurrency``), so a
consumer blocked in ``get`` never stalls producers. Payloads stay out of the actor: the client
``ray.put``s every tensor/array of at least ``inline_bytes`` and the actor holds only the
``ObjectRef`` (metadata travels inline); ``get`` resolves all refs of a batch with one ``ray.get``.

Each call carries its whole batch as one pickled blob plus the list of ObjectRefs inside it
(:func:`encode`): Ray serialises a list of 256 small arrays as 256 out-of-band buffers (~35 us
each), a blob as one -- one actor round trip per batch at a few us per row.

Ownership: a payload is owned by the process that put it (Ray removed ``ray.put(_owner=...)``), so
rows put by a producer that has since died lose their payload; consumers may die freely.
The client is picklable: hand it to any actor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import ray
import torch

from relax.core import lazy_ray
from relax.core.queue.core import Batch, Key, TransferQueue, VersionSpec
from relax.core.queue.packing import decode, encode, parts_for, split


class PackedTransferQueue(TransferQueue):
    """The actor's class: :class:`TransferQueue` plus twins of the batch methods that take and
    return a batch as blob parts (see ``relax.core.queue.packing``)."""

    def put_rows_packed(self, partition: int, args: tuple, refs: list[Any], *parts: bytes) -> list[Key]:
        return self.put_rows(partition, decode(parts, refs), *args)

    def add_columns_packed(self, keys: Sequence[Key], refs: list[Any], *parts: bytes) -> None:
        self.add_columns(keys, decode(parts, refs))

    def get_packed(self, consumer: str, args: tuple, ack: Sequence[Key], n_parts: int) -> tuple:
        """``get`` after acknowledging ``ack`` (the consumer's previous batch) in the same call;
        returns the refs and ``n_parts`` blob parts (``n_parts + 1`` Ray return values).

        An error (a consumer's poll timing out, an unknown key) is returned as :class:`_Raised` in
        place of the refs, not raised: a raised error would fill all ``n_parts + 1`` returns, the
        caller's ``ray.get`` would surface one, and Ray would log the others as unhandled errors.
        """
        try:
            if ack:
                self.ack(consumer, ack)
            batch = self.get(consumer, *args)
        except Exception as err:
            return (_Raised(err), *[b""] * n_parts)
        blob, refs = encode(batch, any(_holds_ref(v) for col in batch.data.values() for v in col))
        return (refs, *split(blob, n_parts))


def _holds_ref(cell: Any) -> bool:
    """A cell that is, or holds, an ObjectRef (a multimodal ``Sample`` keeps its group's shared media
    inputs as one): such a batch is pickled with ref tracking, or the ref would lose its owner."""
    return isinstance(cell, ray.ObjectRef) or isinstance(getattr(cell, "mm_inputs", None), ray.ObjectRef)


class _Raised:
    """An exception carried as a return value (see :meth:`PackedTransferQueue.get_packed`)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


TransferQueueActor = lazy_ray.remote(num_cpus=0, max_concurrency=256)(PackedTransferQueue)

#: extra seconds a client waits for the actor beyond the queue-level timeout before giving up on it
RPC_GRACE_S = 30.0


class _InlineTensor:
    """A small CPU tensor carried inline as its numpy view: pickling a torch tensor costs ~100 us,
    a numpy array ~6 us; the consumer gets a torch tensor back (``torch.from_numpy``, no copy)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _pack_inline(value: Any) -> Any:
    if (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and not value.requires_grad
        and value.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    ):
        return _InlineTensor(value.numpy())
    return value


def _unpack_inline(value: Any) -> Any:
    if not isinstance(value, _InlineTensor):
        return value
    array = value.array  # read-only when Ray hands out a shared buffer: copy those (small anyway)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    return 0


class TransferQueueClient:
    """Talks to a :data:`TransferQueueActor`; same methods and semantics as :class:`TransferQueue`."""

    def __init__(self, actor: Any, inline_bytes: int = 64 << 10):
        self.actor = actor
        self.inline_bytes = inline_bytes
        self.row_bytes = 0.0  # encoded bytes per row of the last ``get``: sizes the next one's parts

    @classmethod
    def create(
        cls,
        capacity: int,
        consumers: Iterable[str] = (),
        lease_timeout_s: float | None = None,
        inline_bytes: int = 64 << 10,
        name: str | None = None,
    ) -> TransferQueueClient:
        """Start the queue actor (named ``name`` if given, so other drivers can :meth:`connect`) on this
        process's node: the queue holds the run's rows, so it lives and dies with the driver, never on a
        node that may be lost mid-run (a rollout node)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict = {"name": name} if name else {}
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
        actor = TransferQueueActor.options(**options).remote(capacity, list(consumers), lease_timeout_s)
        return cls(actor, inline_bytes)

    @classmethod
    def connect(cls, name: str, inline_bytes: int = 64 << 10) -> TransferQueueClient:
        return cls(ray.get_actor(name), inline_bytes)

    def _call(
        self, method: str, *args: Any, timeout: float | None = RPC_GRACE_S, num_returns: int = 1
    ) -> Any:
        try:
            remote = getattr(self.actor, method)
            if num_returns != 1:
                remote = remote.options(num_returns=num_returns)
            return ray.get(remote.remote(*args), timeout=timeout)
        except (
            ray.exceptions.RayTaskError
        ) as err:  # re-raise the queue's own error (TimeoutError, KeyError, ...)
            cause = err.cause
            raise (cause if isinstance(cause, Exception) else err) from None

    def _offload(self, value: Any) -> Any:
        return ray.put(value) if _nbytes(value) >= self.inline_bytes else _pack_inline(value)

    def _offload_rows(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{col: self._offload(v) for col, v in row.items()} for row in rows]

    @staticmethod
    def _encode_offloaded(value: Any, cells: Iterable[Any]) -> tuple[list[Any], list[bytes]]:
        """``value`` (rows or columns whose cells are ``cells``, offloaded) as its refs and blob parts."""
        blob, refs = encode(value, any(_holds_ref(v) for v in cells))
        return refs, split(blob, parts_for(len(blob)))

    @staticmethod
    def _resolve(values: list[Any]) -> list[Any]:
        """``values`` with every ObjectRef replaced by its value, all fetched with one ``ray.get``."""
        out = [_unpack_inline(v) for v in values]
        where = [i for i, v in enumerate(values) if isinstance(v, ray.ObjectRef)]
        if not where:
            return out
        for i, value in zip(where, ray.get([values[i] for i in where]), strict=True):
            out[i] = value
        return out

    @staticmethod
    def _rpc_timeout(timeout: float | None) -> float | None:
        return None if timeout is None else timeout + RPC_GRACE_S

    def put_rows(
        self,
        partition: int,
        rows: Sequence[dict[str, Any]],
        group_ids: Sequence[Any] | None = None,
        version: VersionSpec | list[VersionSpec] = 0,
        group_size: int | None = None,
        timeout: float | None = None,
    ) -> list[Key]:
        offloaded = self._offload_rows(rows)
        refs, parts = self._encode_offloaded(offloaded, (v for row in offloaded for v in row.values()))
        args = (group_ids, version, group_size, timeout)
        return self._call(
            "put_rows_packed", partition, args, refs, *parts, timeout=self._rpc_timeout(timeout)
        )

    def add_columns(self, keys: Sequence[Key], columns: dict[str, Sequence[Any]]) -> None:
        offloaded = {col: [self._offload(v) for v in values] for col, values in columns.items()}
        cells = (v for values in offloaded.values() for v in values)
        refs, parts = self._encode_offloaded(offloaded, cells)
        self._call("add_columns_packed", list(keys), refs, *parts)

    def register_consumer(self, consumer: str) -> None:
        self._call("register_consumer", consumer)

    def get(
        self,
        consumer: str,
        columns: Sequence[str],
        batch_size: int,
        timeout: float | None,
        group_aware: bool = True,
        partition: int | None = None,
        ack: Iterable[Key] = (),
    ) -> Batch:
        """``TransferQueue.get``; ``ack``: keys of this consumer's previous batch, acknowledged in
        the same actor call (a consumer loop then costs one round trip per batch)."""
        args = (list(columns), batch_size, timeout, group_aware, partition)
        n_parts = parts_for(self.row_bytes * batch_size)  # a wrong guess costs speed, never correctness
        refs, *parts = self._call(
            "get_packed",
            consumer,
            args,
            list(ack),
            n_parts,
            timeout=self._rpc_timeout(timeout),
            num_returns=n_parts + 1,
        )
        if isinstance(refs, _Raised):
            raise refs.error
        batch = decode(parts, refs)
        self.row_bytes = sum(map(len, parts)) / max(len(batch.keys), 1)
        cols = list(batch.data)
        flat = self._resolve([v for c in cols for v in batch.data[c]])
        n = len(batch.keys)
        batch.data = {c: flat[j * n : (j + 1) * n] for j, c in enumerate(cols)}
        return batch

    def ack(self, consumer: str, keys: Iterable[Key]) -> None:
        self._call("ack", consumer, list(keys))

    def release(self, consumer: str) -> int:
        return self._call("release", consumer)

    def clear_partition(self, partition: int) -> int:
        return self._call("clear_partition", partition)

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def close(self) -> None:
        """Kill the queue actor (its rows go with it); a second call does nothing."""
        actor, self.actor = self.actor, None
        if actor is not None:
            ray.kill(actor)

    def state_dict(self) -> dict[str, Any]:
        """Like :meth:`TransferQueue.state_dict`, with payloads fetched so the result can be saved anywhere."""
        state = self._call("state_dict")
        cells = [(row["columns"], c) for row in state["rows"] for c in row["columns"]]
        for (columns, c), value in zip(cells, self._resolve([cols[c] for cols, c in cells]), strict=True):
            columns[c] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = [{**row, "columns": self._offload_rows([row["columns"]])[0]} for row in state["rows"]]
        self._call("load_state_dict", {**state, "rows": rows})
