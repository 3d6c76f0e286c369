"""Worker groups: N rank actors of one class, started together, called together, failing together.

Backend-neutral: a rank actor is told its rank, the world size and the rendezvous address
(``master_addr`` / ``master_port``; loopback when every rank shares one node) and forms its own
process group from them. Calls go to every rank with the same arguments; each rank takes its
share by rank, and the answer is rank 0's. If one rank fails or dies, the others are killed (they
would otherwise wait in a collective) and the error names the rank that failed first.

The trainer uses it through a *leader*: rank 0 is the actor the controller holds; it runs its own
share in-process and fans every call out to its peers (``WorkerGroup.run(..., local=...)``), so a
multi-rank trainer looks exactly like a single ``TrainerRole`` to the rest of the controller.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BLAME_GRACE_S = 5.0  # after rank 0 fails, how long peers get to report the failure that caused it
POLL_S = 0.2


class WorkerGroupError(RuntimeError):
    """A rank failed (or died); every rank of the group has been stopped."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous(node_ids: list[str]) -> tuple[str, int]:
    """(master address, port) for ranks placed on ``node_ids`` (rank 0 first): ``127.0.0.1`` when all
    ranks share one node, else rank 0's node IP. The port is probed on rank 0's node."""
    import ray

    local = len(set(node_ids)) == 1
    if node_ids[0] == ray.get_runtime_context().get_node_id():
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        return host, free_port(host)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_probe_port).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_ids[0], soft=False)
    )
    return ray.get(probe.remote(local), timeout=60)


def _probe_port(local: bool) -> tuple[str, int]:
    import ray

    host = "127.0.0.1" if local else ray.util.get_node_ip_address()
    return host, free_port(host)


def spawn(
    actor_cls: Any,
    name: str,
    options: list[dict[str, Any]],
    make_args: Callable[[RankInfo], tuple[tuple, dict]],
    node_ids: list[str],
    timeout_s: float = 600.0,
) -> WorkerGroup:
    """Start ``len(options)`` ranks of ``actor_cls`` (``options[r]``: rank r's Ray options, e.g. a
    placement bundle) with ``make_args(RankInfo)`` and wait until every constructor has returned
    (they rendezvous with each other there). A failed constructor kills all ranks and raises."""
    addr, port = rendezvous(node_ids)
    world = len(options)
    handles = []
    for rank, opts in enumerate(options):
        args, kwargs = make_args(RankInfo(rank, world, addr, port))
        handles.append(actor_cls.options(**opts).remote(*args, **kwargs))
    group = WorkerGroup(name, handles)
    group.wait({r: h.__ray_ready__.remote() for r, h in enumerate(handles)}, "start-up", timeout_s)
    return group


class WorkerGroup:
    """Rank actor handles in rank order (``first_rank``: the rank of ``handles[0]``; a leader holds
    its peers as a group starting at rank 1). Picklable, so it can be handed to a leader actor."""

    def __init__(self, name: str, handles: list[Any], first_rank: int = 0) -> None:
        self.name, self.handles, self.first_rank = name, list(handles), first_rank
        self.failed: str | None = None

    def __len__(self) -> int:
        return len(self.handles)

    def peers(self) -> WorkerGroup:
        """Ranks 1.. as a group, for rank 0 to lead."""
        return WorkerGroup(self.name, self.handles[1:], self.first_rank + 1)

    def call(self, method: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Start ``method(*args)`` on every rank: ObjectRefs by rank. Large arguments are put once."""
        import ray

        if self.failed:
            raise WorkerGroupError(f"{self.name} worker group is stopped: {self.failed}")
        if len(self.handles) > 1:
            args = tuple(ray.put(a) for a in args)
            kwargs = {k: ray.put(v) for k, v in kwargs.items()}
        return {
            self.first_rank + i: getattr(h, method).remote(*args, **kwargs)
            for i, h in enumerate(self.handles)
        }

    def run(self, method: str, *args: Any, local: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """``method`` on every rank; returns rank 0's result.

        With ``local`` (the leader's own share, run here as rank ``first_rank - 1``) the peers run
        concurrently and are watched. A peer that fails while the leader still computes gets every
        peer killed after ``BLAME_GRACE_S`` (which breaks the leader out of any collective it waits
        in) and the error names that peer. If every rank raised the same exception type (e.g. a
        non-finite loss seen by all), the ranks are still in step: the leader's own exception is
        re-raised unchanged and the group stays usable.
        """
        refs = self.call(method, *args, **kwargs)
        if local is None:
            results = self.wait(refs, method)
            return results[min(results)]
        watch = _Watch(self, refs)
        error: BaseException | None = None
        try:
            result = local()
        except BaseException as exc:
            error = exc
        outcomes = watch.finish(error is not None)
        peer_errors = {r: e for r, e in outcomes.items() if isinstance(e, BaseException)}
        if error is None and not peer_errors:
            return result
        me = self.first_rank - 1
        if error is not None and _same_failure(error, peer_errors, len(self.handles)):
            raise error
        first = watch.first_failure
        if first is not None:  # a peer failed first: the leader's error, if any, is the broken collective
            text = f"{self.name} rank {first} failed during {method}: {_describe(peer_errors[first])}"
            if error is not None:
                text += f"; rank {me} then failed with {_describe(error)}"
        else:
            stuck = sorted(r for r, e in outcomes.items() if e is _STUCK)
            text = f"{self.name} rank {me} failed during {method}: {_describe(error)}"
            text += f"; rank(s) {stuck} had not finished" if stuck else ""
        self._fail(text)
        raise WorkerGroupError(self.failed) from error or peer_errors[first]

    def wait(self, refs: dict[int, Any], what: str, timeout_s: float | None = None) -> dict[int, Any]:
        """Results by rank; the first failure (or the deadline) kills every rank and raises."""
        import ray

        by_ref = {ref: rank for rank, ref in refs.items()}
        pending, results = list(refs.values()), {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                ranks = sorted(by_ref[r] for r in pending)
                self._fail(f"{self.name} rank(s) {ranks} did not finish {what} within {timeout_s:g}s")
                raise WorkerGroupError(self.failed)
            rank = by_ref[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except Exception as exc:
                self._fail(f"{self.name} rank {rank} failed during {what}: {_describe(exc)}")
                raise WorkerGroupError(self.failed) from exc
        return results

    def _fail(self, message: str) -> None:
        self.failed = self.failed or f"{message} (all ranks of the group were stopped)"
        self.kill()

    def kill(self) -> None:
        import ray

        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass


_STUCK = object()  # outcome of a peer still running when the leader gave up on it


class _Watch:
    """Collects the peers' outcomes in a thread while the leader computes. On the first peer
    failure it gives the leader ``BLAME_GRACE_S`` to finish; if the leader is still busy (waiting in
    a collective for the failed peer), it kills the peers."""

    def __init__(self, group: WorkerGroup, refs: dict[int, Any]) -> None:
        self.group, self.refs = group, refs
        self.outcomes: dict[int, Any] = {}
        self.first_failure: int | None = None
        self.leader_done = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"relax-{group.name}-watch").start()

    def _run(self) -> None:
        import ray

        by_ref = {ref: rank for rank, ref in self.refs.items()}
        pending = list(self.refs.values())
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                rank = by_ref[ref]
                try:
                    self.outcomes[rank] = ray.get(ref)
                except BaseException as exc:
                    self.outcomes[rank] = exc
                    if self.first_failure is None:
                        self.first_failure = rank
                        if not self.leader_done.wait(BLAME_GRACE_S):
                            self.group.kill()
            if self.done.is_set():
                break
        self.done.set()

    def finish(self, leader_failed: bool) -> dict[int, Any]:
        """Every peer's result or exception; after a leader failure, peers still running after
        ``BLAME_GRACE_S`` are marked stuck and killed (they wait in a collective for the leader)."""
        self.leader_done.set()
        if not self.done.wait(BLAME_GRACE_S if leader_failed else None):
            self.done.set()
            self.group.kill()
        return {r: self.outcomes.get(r, _STUCK) for r in self.refs}


def _same_failure(error: BaseException, peer_errors: dict[int, BaseException], peers: int) -> bool:
    """Every peer raised (none died, none stuck) the leader's exception type."""
    import ray.exceptions

    if len(peer_errors) != peers:
        return False
    causes = [
        getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
        for e in peer_errors.values()
    ]
    return all(c is not None and type(c) is type(error) for c in causes)


def _describe(exc: BaseException) -> str:
    import ray.exceptions

    if isinstance(exc, ray.exceptions.RayActorError):
        if getattr(exc, "_actor_init_failed", False):  # the constructor raised: say what
            return f"constructor failed: {str(exc).strip().splitlines()[-1]}"
        return "actor died"
    kind = type(getattr(exc, "cause", None) or exc).__name__  # a rank's RayTaskError: its own exception
    text = str(exc).strip().splitlines()
    last = text[-1] if text else ""
    return last if last.startswith(f"{kind}:") else f"{kind}: {last}"
