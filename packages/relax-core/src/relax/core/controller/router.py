"""Routing generation over a mutable set of engine actors, group by group, with resubmission.

The router sends each chunk of whole groups to the engine with the fewest outstanding requests
and yields groups as soon as their chunk returns, so downstream roles start on early groups while
late (long-tail) ones are still generating.

Engines carry stable, unique indices (a replacement gets a new one), so errors and metrics name
them. The set may change at any time (:meth:`EngineRouter.add_engine` / ``remove_engine``, from
any thread): a chunk whose engine left -- removed, died, or did not answer within
``rollout.timeout_s`` -- is sent again to the remaining engines and its late result, if any, is
ignored, so every request is answered exactly once (no sample lost, none duplicated).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from relax.core.controller import local
from relax.core.controller.faults import NoEnginesLeft, RoleError, describe
from relax.core.controller.samples import apply_result, request_for
from relax.core.data import Sample
from relax.core.failures import add_failure
from relax.core.protocols import SamplingParams

POLL_S = 0.2  # how often a waiting stream notices engines leaving

#: ``on_failure(index, reason)``: called when a generate call finds its engine dead or stuck
FailureHandler = Callable[[int, str], None]


class EngineRouter:
    """Least-outstanding-requests load balancing over engine actor handles keyed by engine index.

    Thread-safe. ``on_failure`` decides what a failed engine means (the fleet evicts and replaces
    it); without one the engine is just removed, and losing the last one closes the router.
    """

    def __init__(
        self, engines: Sequence[Any] | Mapping[int, Any] = (), on_failure: FailureHandler | None = None
    ) -> None:
        items = dict(engines) if isinstance(engines, Mapping) else dict(enumerate(engines))
        self._engines: dict[int, Any] = items
        self._outstanding: dict[int, int] = dict.fromkeys(items, 0)
        self._retired: set[int] = set()
        self._draining: set[int] = set()  # live, but sent no new requests (graceful scale-in)
        self._cv = threading.Condition()
        self._closed: BaseException | None = None
        self.on_failure = on_failure
        self.resubmitted = 0  # requests sent again because their engine left
        self.explain: Callable[[], str | None] = lambda: (
            None
        )  # why no engine is live (for the timeout's error)

    # ------------------------------------------------------------------ the engine set
    def add_engine(self, handle: Any, index: int) -> None:
        """Start routing to ``handle`` as engine ``index`` (indices are never reused)."""
        with self._cv:
            if index in self._engines or index in self._retired:
                raise ValueError(
                    f"rollout engine[{index}] already exists or existed; indices are never reused"
                )
            self._engines[index] = handle
            self._outstanding[index] = 0
            self._closed = None
            self._cv.notify_all()

    def remove_engine(self, index: int) -> Any | None:
        """Stop routing to engine ``index``; its in-flight chunks are resubmitted by their streams.
        Returns its handle, or None if it was not routed to (already removed)."""
        with self._cv:
            handle = self._engines.pop(index, None)
            self._outstanding.pop(index, None)
            self._draining.discard(index)
            if handle is not None:
                self._retired.add(index)
            self._cv.notify_all()
            return handle

    def live(self) -> dict[int, Any]:
        with self._cv:
            return dict(self._engines)

    def drain(self, index: int) -> None:
        """Send engine ``index`` no new requests while its in-flight ones finish (it stays live, so
        they are not resubmitted); it is still used if every live engine is draining."""
        with self._cv:
            if index in self._engines:
                self._draining.add(index)

    def draining(self) -> set[int]:
        with self._cv:
            return set(self._draining)

    def outstanding(self) -> dict[int, int]:
        """Requests in flight per live engine (its load)."""
        with self._cv:
            return dict(self._outstanding)

    def __len__(self) -> int:
        with self._cv:
            return len(self._engines)

    def close(self, error: BaseException) -> None:
        """No engine will come back: streams waiting for one raise ``error``."""
        with self._cv:
            self._closed = error
            self._cv.notify_all()

    @property
    def closed(self) -> BaseException | None:
        return self._closed

    def closed_error(self) -> BaseException:
        """A fresh copy of the closing error (several streams may raise it at once)."""
        err = self._closed
        return type(err)(*err.args) if err is not None else RuntimeError("router is open")

    def report_failure(self, index: int, reason: str) -> None:
        if self.on_failure is not None:
            self.on_failure(index, reason)
            return
        self.remove_engine(index)
        with self._cv:
            if not self._engines:
                self.close(NoEnginesLeft(f"{reason}; no rollout engine left"))

    # ------------------------------------------------------------------ dispatch
    def submit(self, requests: list[Any], wait_s: float, prefer: int | None = None) -> tuple[Any, int]:
        """Send ``requests`` to the least loaded engine, waiting up to ``wait_s`` for one to exist;
        ``prefer``: this engine while it is live and not draining (it holds what they continue)."""
        with self._cv:
            ready = self._cv.wait_for(lambda: self._engines or self._closed is not None, wait_s)
            if self._closed is not None:
                raise self.closed_error()
            if not ready:
                why = self.explain()  # what the run waits for (the fleet: a node with the label, ...)
                raise NoEnginesLeft(
                    f"no rollout engine became available within {wait_s:g}s" + (f"; {why}" if why else "")
                )
            idx = min(
                self._engines, key=lambda i: (i in self._draining, i != prefer, self._outstanding[i], i)
            )
            self._outstanding[idx] += len(requests)
            handle = self._engines[idx]
        return handle.generate.remote(requests), idx

    def done(self, idx: int, n: int) -> None:
        with self._cv:
            if idx in self._outstanding:
                self._outstanding[idx] -= n

    def count_resubmitted(self, n: int) -> None:
        with self._cv:
            self.resubmitted += n


@dataclass
class _Call:
    index: int  # engine serving it
    groups: list[list[Sample]]
    samples: list[Sample]
    sent: float  # monotonic time
    lost: str = ""  # why it is resubmitted (an engine failure, relax.core.failures)


def stream_groups(
    router: EngineRouter,
    groups: list[list[Sample]],
    params: SamplingParams,
    seed: int,
    step: int,
    timeout_s: float,
    chunks_per_engine: int = 2,
    turns: Any = None,
) -> Iterator[tuple[list[list[Sample]], int]]:
    """Generate every group; yield (finished groups, number of requests sent again).

    With ``turns`` (``relax.core.agentic.Turns``, multi-turn rollouts) each request is a sample's
    next turn and each result goes to ``turns.advance``; the samples whose episode goes on are sent
    again, so a group is yielded once every episode in its chunk ended.

    A request comes back again with finish reason ``"abort"`` (weights changed under it with
    ``rollout.partial_rollout: abort``) and is resubmitted from scratch with the same seed. A chunk
    whose engine dies, is removed, or takes longer than ``timeout_s`` is resubmitted to the other
    engines after ``router.report_failure`` (which evicts a dead or stuck engine). Each request id
    (``step/group/index``) is applied to its sample exactly once.
    """
    n_chunks = max(1, min(len(groups), chunks_per_engine * max(1, len(router))))
    pending: dict[Any, _Call] = {}

    make_request = turns.request if turns is not None else request_for

    def send(chunk_groups: list[list[Sample]], samples: list[Sample], prefer: int | None = None) -> None:
        ref, idx = router.submit([make_request(s, params, seed, step) for s in samples], timeout_s, prefer)
        pending[ref] = _Call(idx, chunk_groups, samples, time.monotonic())

    for i in range(n_chunks):
        chunk = groups[i::n_chunks]
        send(chunk, [s for g in chunk for s in g])
    while pending:
        if router.closed is not None:
            raise router.closed_error()
        first_deadline = min(c.sent for c in pending.values()) + timeout_s
        wait_s = min(POLL_S, max(0.0, first_deadline - time.monotonic()))
        ready, _ = local.wait(list(pending), num_returns=1, timeout=wait_s)
        lost: list[_Call] = []
        if ready:
            call = pending.pop(ready[0])
            router.done(call.index, len(call.samples))
            try:
                results = local.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the engine process is gone
                call.lost = f"rollout engine[{call.index}] died during generate ({describe(exc)})"
                router.report_failure(call.index, call.lost)
                lost.append(call)
            except (
                Exception
            ) as exc:  # the engine raised (in its actor or the driver): a bug, not a lost engine
                raise RoleError(
                    f"rollout engine[{call.index}] failed in generate: {describe(exc)}",
                    "rollout engine",
                    call.index,
                    "generate",
                ) from exc
            else:
                aborted, answered = [], []
                for sample, result in zip(call.samples, results, strict=True):
                    if result.finish_reason == "abort":
                        aborted.append(sample)
                    elif turns is None:
                        apply_result(sample, result)
                    else:
                        answered.append((sample, result))
                next_turns = turns.advance(step, *map(list, zip(*answered, strict=True))) if answered else []
                if aborted or next_turns:  # next turns go back to the engine holding their prefix
                    send(call.groups, aborted + next_turns, prefer=call.index if next_turns else None)
                    yield [], len(aborted)
                else:
                    yield call.groups, 0
        lost += _drop_lost(router, pending, timeout_s)
        for call in lost:
            router.count_resubmitted(len(call.samples))
            for sample in call.samples:  # reported with the step's failures; the sample itself is not lost
                why = (
                    call.lost
                    or f"rollout engine[{call.index}] left the fleet (lost or removed) during generate"
                )
                add_failure(sample, "engine", f"{why}; its request was resubmitted")
            send(call.groups, call.samples)
        if lost:
            yield [], sum(len(c.samples) for c in lost)


def _drop_lost(router: EngineRouter, pending: dict[Any, _Call], timeout_s: float) -> list[_Call]:
    """Remove from ``pending`` the calls whose engine left the router or overran ``timeout_s``."""
    live, now, lost = router.live(), time.monotonic(), []
    for ref, call in list(pending.items()):
        if call.index in live and now - call.sent > timeout_s:
            call.lost = f"rollout engine[{call.index}] did not finish generate within {timeout_s:g}s"
            router.report_failure(call.index, call.lost)
            live = router.live()
        if call.index not in live:
            del pending[ref]
            router.done(call.index, len(call.samples))
            lost.append(call)
    return lost
