"""In-process transfer queue: rows keyed by (partition, index), read by column, one cursor per consumer.

Thread-safe (one condition variable guards everything), so the same class runs in a driver thread
pool or, wrapped by ``ray.remote(max_concurrency=...)``, as the shared queue actor. Values are stored
as given: the Ray client stores ``ObjectRef``s for large tensors, this class never looks inside.

Delivery rules, per consumer role: a row is handed out once it has every requested column and is
neither leased to nor acknowledged by that role; a handed-out row is leased until ``ack`` (never
handed to that role again) or until the lease is dropped by ``release`` / lease expiry (handed out
again). A row is evicted once every registered consumer acknowledged it.

The run uses only the contract (``relax.core.protocols.TransferQueueLike``: ``put_rows``, ``get``,
``add_columns``, ``ack``, ``metrics``, ``close``); ``group_size``, ``group_aware=False``,
``register_consumer``, ``release``, leases, ``clear_partition`` and ``state_dict`` are features of
this class for other callers (tools, tests), not part of what a queue plugin must offer.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.core.protocols import Batch, Key, VersionSpec

__all__ = ["Batch", "Key", "TransferQueue", "VersionSpec"]


@dataclass
class _Row:
    group_id: Any
    gkey: tuple
    version: tuple[int, int]
    columns: dict[str, Any]
    acked: set[str] = field(default_factory=set)
    leases: dict[str, float] = field(default_factory=dict)  # consumer -> lease deadline (monotonic)


@dataclass
class _Group:
    keys: list[Key]
    size: int  # expected number of rows; the group is deliverable once it has them all


def _versions(version: VersionSpec | list[VersionSpec], n: int) -> list[tuple[int, int]]:
    """An int or a (min, max) tuple applies to every row; a list gives one per row."""

    def one(v: VersionSpec) -> tuple[int, int]:
        lo, hi = (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))
        if lo > hi:
            raise ValueError(f"version range {v!r} has min > max")
        return lo, hi

    if isinstance(version, (int, tuple)):
        return [one(version)] * n
    if len(version) != n:
        raise ValueError(f"got {len(version)} versions for {n} rows")
    return [one(v) for v in version]


class TransferQueue:
    """Bounded row store with per-consumer cursors, leases, acks and group-aware batching."""

    def __init__(self, capacity: int, consumers: Iterable[str] = (), lease_timeout_s: float | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.lease_timeout_s = lease_timeout_s
        self._cv = threading.Condition()
        self._consumers: set[str] = set(consumers)
        self._rows: dict[Key, _Row] = {}  # insertion order = delivery order
        self._groups: dict[tuple, _Group] = {}
        self._next_index: dict[int, int] = {}
        self._counters: dict[str, float] = {"rows_produced": 0, "max_rows": 0, "put_wait_s": 0.0}

    # ----------------------------------------------------------------- producers
    def put_rows(
        self,
        partition: int,
        rows: Sequence[dict[str, Any]],
        group_ids: Sequence[Any] | None = None,
        version: VersionSpec | list[VersionSpec] = 0,
        group_size: int | None = None,
        timeout: float | None = None,
    ) -> list[Key]:
        """Append rows to ``partition``; blocks while the queue is full (``TimeoutError`` after ``timeout``).

        Rows sharing a group id form a group, delivered whole by group-aware ``get``. Without
        ``group_size`` a group is exactly the rows given here; with it, a group may arrive over
        several calls and becomes deliverable once it holds ``group_size`` rows.
        """
        n = len(rows)
        if group_ids is not None and len(group_ids) != n:
            raise ValueError(f"{len(group_ids)} group ids for {n} rows")
        if n > self.capacity:
            raise ValueError(f"cannot put {n} rows into a queue of capacity {self.capacity}")
        versions = _versions(version, n)
        start = time.monotonic()
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._rows) + n <= self.capacity, timeout):
                raise TimeoutError(
                    f"transfer queue full: put of {n} rows to partition {partition} waited {timeout}s "
                    f"({len(self._rows)}/{self.capacity} rows held; pending acks {self._pending_summary()})"
                )
            self._counters["put_wait_s"] += time.monotonic() - start
            gkeys = self._check_groups(partition, group_ids, n, group_size)
            base = self._next_index.get(partition, 0)
            keys = [(partition, base + i) for i in range(n)]
            self._next_index[partition] = base + n
            for i, (key, row, gkey) in enumerate(zip(keys, rows, gkeys, strict=True)):
                gid = None if group_ids is None else group_ids[i]
                self._rows[key] = _Row(gid, gkey, versions[i], dict(row))
                group = self._groups.setdefault(gkey, _Group([], group_size or 1))
                group.keys.append(key)
            if group_size is None and group_ids is not None:
                for gkey in set(gkeys):
                    self._groups[gkey].size = len(self._groups[gkey].keys)
            self._counters["rows_produced"] += n
            self._counters["max_rows"] = max(self._counters["max_rows"], len(self._rows))
            self._cv.notify_all()
            return keys

    def _check_groups(self, partition: int, group_ids: Sequence[Any] | None, n: int, group_size: int | None):
        base = self._next_index.get(partition, 0)
        if group_ids is None:
            if group_size not in (None, 1):
                raise ValueError("group_size needs group_ids")
            return [("row", partition, base + i) for i in range(n)]
        gkeys = [("group", partition, gid) for gid in group_ids]
        counts: dict[tuple, int] = {}
        for gkey in gkeys:
            counts[gkey] = counts.get(gkey, 0) + 1
        for gkey, count in counts.items():
            existing = self._groups.get(gkey)
            if existing is not None and group_size is None:
                raise ValueError(
                    f"group {gkey[2]!r} of partition {partition} is already complete; pass group_size to grow groups over several puts"
                )
            have = len(existing.keys) if existing else 0
            if existing is not None and existing.size != group_size:
                raise ValueError(
                    f"group {gkey[2]!r} was declared with size {existing.size}, not {group_size}"
                )
            if group_size is not None and have + count > group_size:
                raise ValueError(
                    f"group {gkey[2]!r} would hold {have + count} rows > group_size {group_size}"
                )
        return gkeys

    def add_columns(self, keys: Sequence[Key], columns: dict[str, Sequence[Any]]) -> None:
        """Set columns (reward, ref logprobs, advantages, ...) on rows that are already in the queue."""
        for col, values in columns.items():
            if len(values) != len(keys):
                raise ValueError(f"column {col!r} has {len(values)} values for {len(keys)} keys")
        with self._cv:
            keys = [tuple(k) for k in keys]
            missing = [k for k in keys if k not in self._rows]
            if missing:
                raise KeyError(
                    f"rows {missing[:5]} not in the transfer queue (evicted, cleared or never put)"
                )
            for col, values in columns.items():
                for key, value in zip(keys, values, strict=True):
                    self._rows[key].columns[col] = value
            self._cv.notify_all()

    # ----------------------------------------------------------------- consumers
    def register_consumer(self, consumer: str) -> None:
        """Declare a consumer role: rows are evicted only after every declared role acknowledged them."""
        with self._cv:
            self._consumers.add(consumer)
            self._counters.setdefault(f"rows_consumed/{consumer}", 0)
            self._counters.setdefault(f"wait_s/{consumer}", 0.0)

    def get(
        self,
        consumer: str,
        columns: Sequence[str],
        batch_size: int,
        timeout: float | None,
        group_aware: bool = True,
        partition: int | None = None,
    ) -> Batch:
        """Lease ``batch_size`` rows that have all ``columns`` to ``consumer`` (blocks up to ``timeout``).

        Group-aware batches hold whole groups in arrival order (first fit), so ``batch_size`` should
        be a sum of group sizes. ``partition`` restricts the batch to one rollout step (a trainer
        that must see step ``k`` exactly while later steps are already arriving). An unknown consumer is registered on its first call; declare roles
        up front (constructor / ``register_consumer``) so no row is evicted before they see it.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        columns = list(columns)
        self.register_consumer(consumer)
        start = time.monotonic()
        deadline = math.inf if timeout is None else start + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                next_expiry = self._expire_leases(now)
                keys = self._select(consumer, columns, batch_size, group_aware, partition)
                if keys is not None:
                    break
                if now >= deadline:
                    self._counters[f"wait_s/{consumer}"] += now - start
                    raise TimeoutError(self._timeout_message(consumer, columns, batch_size, timeout))
                wake = min(deadline, next_expiry)
                self._cv.wait(None if wake == math.inf else wake - now)
            lease_end = math.inf if self.lease_timeout_s is None else now + self.lease_timeout_s
            for key in keys:
                self._rows[key].leases[consumer] = lease_end
            self._counters[f"wait_s/{consumer}"] += time.monotonic() - start
            rows = [self._rows[k] for k in keys]
            return Batch(
                keys=list(keys),
                data={col: [r.columns[col] for r in rows] for col in columns},
                group_ids=[r.group_id for r in rows],
                versions=[r.version for r in rows],
            )

    def _ready(self, row: _Row, consumer: str, columns: list[str]) -> bool:
        return (
            consumer not in row.acked
            and consumer not in row.leases
            and all(c in row.columns for c in columns)
        )

    def _select(
        self,
        consumer: str,
        columns: list[str],
        batch_size: int,
        group_aware: bool,
        partition: int | None = None,
    ) -> list[Key] | None:
        chosen: list[Key] = []
        if not group_aware:
            for key, row in self._rows.items():
                if (partition is None or key[0] == partition) and self._ready(row, consumer, columns):
                    chosen.append(key)
                    if len(chosen) == batch_size:
                        return chosen
            return None
        seen: set[tuple] = set()
        for key, row in self._rows.items():
            if row.gkey in seen or (partition is not None and key[0] != partition):
                continue
            seen.add(row.gkey)
            group = self._groups[row.gkey]
            if len(group.keys) < group.size:
                continue  # still being produced
            todo = [k for k in group.keys if k in self._rows and consumer not in self._rows[k].acked]
            if not todo or not all(self._ready(self._rows[k], consumer, columns) for k in todo):
                continue
            if len(todo) > batch_size:
                raise ValueError(
                    f"group {row.group_id!r} has {len(todo)} rows, more than batch_size {batch_size}"
                )
            if len(chosen) + len(todo) <= batch_size:
                chosen.extend(todo)
                if len(chosen) == batch_size:
                    return chosen
        return None

    def _timeout_message(
        self, consumer: str, columns: list[str], batch_size: int, timeout: float | None
    ) -> str:
        ready = sum(self._ready(r, consumer, columns) for r in self._rows.values())
        lacking = {c: sum(c not in r.columns for r in self._rows.values()) for c in columns}
        lacking = {c: n for c, n in lacking.items() if n}
        return (
            f"transfer queue: consumer {consumer!r} waited {timeout}s for {batch_size} rows with columns "
            f"{columns}; {ready} ready, {len(self._rows)} held, rows lacking each column: {lacking or 'none'}"
        )

    def ack(self, consumer: str, keys: Iterable[Key]) -> None:
        """Mark rows done for ``consumer``: never handed to it again; evicted once every role acked."""
        with self._cv:
            for key in keys:
                key = tuple(key)
                row = self._rows.get(key)
                if row is None or consumer in row.acked:
                    continue  # already evicted or acknowledged: acks are idempotent
                row.leases.pop(consumer, None)
                row.acked.add(consumer)
                self._counters[f"rows_consumed/{consumer}"] = (
                    self._counters.get(f"rows_consumed/{consumer}", 0) + 1
                )
                if self._consumers <= row.acked:
                    self._evict(key)
            self._cv.notify_all()

    def release(self, consumer: str) -> int:
        """Declare ``consumer`` dead: its unacknowledged rows are handed out again. Returns their count."""
        with self._cv:
            n = 0
            for row in self._rows.values():
                n += row.leases.pop(consumer, None) is not None
            self._cv.notify_all()
            return n

    def _expire_leases(self, now: float) -> float:
        """Drop expired leases; return the next lease deadline (inf if none)."""
        nxt = math.inf
        for row in self._rows.values():
            for consumer, end in list(row.leases.items()):
                if end <= now:
                    del row.leases[consumer]
                else:
                    nxt = min(nxt, end)
        return nxt

    # ----------------------------------------------------------------- housekeeping
    def _evict(self, key: Key) -> None:
        row = self._rows.pop(key)
        group = self._groups[row.gkey]
        if len(group.keys) >= group.size and all(k not in self._rows for k in group.keys):
            del self._groups[row.gkey]

    def clear_partition(self, partition: int) -> int:
        """Drop every row of ``partition`` (acknowledged or not). Returns how many were dropped."""
        with self._cv:
            keys = [k for k in self._rows if k[0] == partition]
            for key in keys:
                del self._rows[key]
            for gkey in [g for g in self._groups if g[1] == partition]:
                del self._groups[gkey]
            self._cv.notify_all()
            return len(keys)

    def _pending_summary(self) -> dict[str, int]:
        return {c: sum(c not in r.acked for r in self._rows.values()) for c in sorted(self._consumers)}

    def metrics(self) -> dict[str, float]:
        """Flat gauges and counters: depth per column, rows produced/consumed, wait seconds per consumer."""
        with self._cv:
            out: dict[str, float] = {"queue/rows": len(self._rows), "queue/capacity": self.capacity}
            for row in self._rows.values():
                for col in row.columns:
                    out[f"queue/depth/{col}"] = out.get(f"queue/depth/{col}", 0) + 1
            for consumer in self._consumers:
                out[f"queue/leased/{consumer}"] = sum(consumer in r.leases for r in self._rows.values())
            out.update({f"queue/{name}": value for name, value in self._counters.items()})
            return out

    def close(self) -> None:
        """Nothing to release: the rows go with the object."""

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Unconsumed rows, per-consumer acks (the cursors) and counters; leases are not saved, so
        rows handed out but not acknowledged are handed out again after ``load_state_dict``."""
        with self._cv:
            return {
                "consumers": sorted(self._consumers),
                "next_index": dict(self._next_index),
                "rows": [
                    {
                        "key": k,
                        "group_id": r.group_id,
                        "gkey": r.gkey,
                        "version": r.version,
                        "columns": dict(r.columns),
                        "acked": sorted(r.acked),
                    }
                    for k, r in self._rows.items()
                ],
                "groups": [(gkey, g.size, list(g.keys)) for gkey, g in self._groups.items()],
                "counters": dict(self._counters),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cv:
            self._consumers = set(state["consumers"])
            self._next_index = {int(p): int(n) for p, n in state["next_index"].items()}
            self._groups = {
                tuple(g): _Group([tuple(k) for k in keys], size) for g, size, keys in state["groups"]
            }
            self._rows = {
                tuple(r["key"]): _Row(
                    r["group_id"], tuple(r["gkey"]), tuple(r["version"]), dict(r["columns"]), set(r["acked"])
                )
                for r in state["rows"]
            }
            self._counters = dict(state["counters"])
            self._cv.notify_all()
