"""What the control API serves, kept in one place (the hub actor): the driver's latest run snapshot,
the operations it was asked for, and the commands waiting for the driver.

Pure Python (no Ray, no HTTP) so the rules are tested directly: one scale operation at a time,
scale-in never touches protected engines nor the last serving one, every operation moves through
named states to exactly one terminal state.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

#: operation states; a scale-out goes pending -> creating -> health-checking -> weight-syncing -> active
SCALE_OUT_PHASES = ("pending", "creating", "health-checking", "weight-syncing", "active")
STATES = (*SCALE_OUT_PHASES, "draining", "saving", "done", "failed", "cancelled")
TERMINAL = frozenset({"active", "done", "failed", "cancelled"})
SCALE_KINDS = frozenset({"scale_out", "scale_in"})
KINDS = (*sorted(SCALE_KINDS), "pause", "resume", "checkpoint")


class ControlError(Exception):
    """A request the run cannot take; ``status`` is the HTTP status the API answers with."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(status, detail)  # both in args: the error crosses Ray by pickling
        self.status, self.detail = status, detail

    def __str__(self) -> str:
        return self.detail


@dataclass
class Operation:
    id: str
    kind: str
    state: str
    request: dict[str, Any]
    source: str  # "api" or "autoscaler"
    created: float
    updated: float
    engine_ids: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str | None = None
    history: list[str] = field(default_factory=list)


class ControlState:
    """The hub's state. Every method is called by one actor thread at a time (no locking here)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"state": "starting", "engines": []}
        self.ops: dict[str, Operation] = {}
        self.inbox: list[dict[str, Any]] = []
        self._count = 0

    # ------------------------------------------------------------------ the driver's side
    def exchange(self, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
        """Store the driver's latest snapshot; hand it the commands queued since the last call."""
        self.snapshot = snapshot
        commands, self.inbox = self.inbox, []
        for command in commands:
            self.ops[command["op"]].history.append("taken")
        return commands

    def update(self, op_id: str, state: str, **fields: Any) -> None:
        """Move operation ``op_id`` to ``state`` (a terminal state is final)."""
        op = self.ops[op_id]
        if op.state in TERMINAL:
            return
        if state not in STATES:
            raise ValueError(f"unknown operation state {state!r}; known: {STATES}")
        op.state, op.updated = state, time.time()
        op.history.append(state)
        for key, value in fields.items():
            setattr(op, key, value)

    def finish(self, status: str, snapshot: dict[str, Any]) -> None:
        """The run ended (``status``): publish its last state; operations not finished are cancelled."""
        self.snapshot = {**snapshot, "state": "finished", "status": status}
        self.inbox = []
        for op in self.ops.values():
            self.update(op.id, "cancelled", error=f"the run ended ({status}) before the operation finished")

    # ------------------------------------------------------------------ the API's side
    def status(self) -> dict[str, Any]:
        current = self.current_scale_op()
        return {**self.snapshot, "operation": asdict(current) if current else None}

    def engines(self) -> list[dict[str, Any]]:
        return list(self.snapshot.get("engines", []))

    def metrics(self) -> dict[str, Any]:
        return dict(self.snapshot.get("metrics", {}))

    def operation(self, op_id: str) -> dict[str, Any]:
        if op_id not in self.ops:
            raise ControlError(404, f"no operation {op_id!r}")
        return asdict(self.ops[op_id])

    def operations(self) -> list[dict[str, Any]]:
        return [asdict(op) for op in self.ops.values()]

    def current_scale_op(self) -> Operation | None:
        return next(
            (op for op in self.ops.values() if op.kind in SCALE_KINDS and op.state not in TERMINAL), None
        )

    def submit(self, kind: str, request: dict[str, Any], source: str = "api") -> dict[str, Any]:
        """Queue an operation for the driver; raises :class:`ControlError` (409/404) when the run
        cannot take it now."""
        if kind not in KINDS:
            raise ControlError(400, f"unknown operation kind {kind!r}; known: {', '.join(KINDS)}")
        if self.snapshot.get("state") in ("finished", "starting"):
            raise ControlError(409, f"the run is {self.snapshot['state']}; it takes no operations now")
        engine_ids: list[int] = []
        if kind in SCALE_KINDS:
            if (busy := self.current_scale_op()) is not None:
                raise ControlError(
                    409,
                    f"operation {busy.id} ({busy.kind}) is still {busy.state}; one scale operation at a time",
                )
            if kind == "scale_out" and request.get("urls") and not self.snapshot.get("attach"):
                raise ControlError(
                    400,
                    f"urls: rollout engine {self.snapshot.get('engine')!r} cannot attach external "
                    "engines; scale out with num_engines",
                )
            if kind == "scale_in":
                engine_ids = self._scale_in_targets(request)
                request = {**request, "engine_ids": engine_ids}
        self._count += 1
        now = time.time()
        op = Operation(
            f"op-{self._count}", kind, "pending", request, source, now, now, engine_ids, history=["pending"]
        )
        self.ops[op.id] = op
        self.inbox.append({"op": op.id, "kind": kind, "request": request})
        return asdict(op)

    def cancel(self, op_id: str) -> dict[str, Any]:
        """Cancel an operation the driver has not taken yet."""
        op = self.ops.get(op_id)
        if op is None:
            raise ControlError(404, f"no operation {op_id!r}")
        if not any(c["op"] == op_id for c in self.inbox):
            raise ControlError(
                409, f"operation {op_id} is {op.state}; only an operation not started yet can be cancelled"
            )
        self.inbox = [c for c in self.inbox if c["op"] != op_id]
        self.update(op_id, "cancelled", error="cancelled by request")
        return asdict(op)

    def _scale_in_targets(self, request: dict[str, Any]) -> list[int]:
        """Which engines a scale-in removes: the ones named, or the ``num_engines`` least loaded
        unprotected ones (newest first on ties); never a protected engine, never the last one."""
        engines = {e["engine_id"]: e for e in self.snapshot.get("engines", []) if not e.get("draining")}
        if ids := request.get("engine_ids"):
            unknown = sorted(set(ids) - set(engines))
            if unknown:
                raise ControlError(404, f"engine_ids: {unknown} not serving; serving: {sorted(engines)}")
            protected = sorted(i for i in ids if engines[i].get("protected"))
            if protected:
                raise ControlError(
                    409,
                    f"engine_ids: {protected} are protected (present from the start; "
                    "control.protect_initial_engines)",
                )
            targets = sorted(set(ids))
        else:
            n = request["num_engines"]
            removable = sorted(
                (e for e in engines.values() if not e.get("protected")),
                key=lambda e: (e.get("load", 0), -e["engine_id"]),
            )
            if n > len(removable):
                raise ControlError(
                    409,
                    f"num_engines: {n} requested but only {len(removable)} engine(s) can be "
                    f"removed ({len(engines) - len(removable)} protected)",
                )
            targets = sorted(e["engine_id"] for e in removable[:n])
        if len(targets) >= len(engines):
            raise ControlError(409, f"scale-in would leave no serving engine (serving: {sorted(engines)})")
        return targets
