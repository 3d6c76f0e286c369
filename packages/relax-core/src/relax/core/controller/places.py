"""Where a rollout engine can live on the cluster: what the fleet asks Ray before it starts a replacement.

A node that is lost is not declared dead by Ray at once (its health checks must fail first: seconds
to tens of seconds), while its engines' calls fail at once. A replacement placed in that window lands
on the dead node's reservation and dies with it. So before replacing an engine the fleet waits for
:meth:`EnginePlaces.verdict` on the node it ran on -- a probe task pinned to that node answers (the
node is alive: the engine alone failed) or Ray declares the node dead -- and then for the engine's
reservation (its placement group bundle, which Ray moves off a dead node once some node with the
label has room) to sit on an alive node: :meth:`EnginePlaces.slot_node`. What it waits for is said
in words an operator can act on (:meth:`EnginePlaces.wants`): the label, the resources, and the
``ray start`` line that would provide them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

log = logging.getLogger("relax")

POLL_S = 0.5


def _probe() -> bool:
    """Runs on the node asked about: answering at all is the verdict "alive"."""
    return True


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class EnginePlaces:
    """The Ray side of engine recovery for one run: ``placement`` (the run's granted groups, or None),
    ``label`` (``ray.nodes.rollout``, or None) and what one engine asks (``cpus``, ``gpus``)."""

    def __init__(self, placement: Any | None, label: str | None, cpus: float, gpus: float) -> None:
        self.placement, self.label, self.cpus, self.gpus = placement, label, cpus, gpus

    def node_of(self, handle: Any) -> str | None:
        """The Ray node id an engine actor ran on (None: unknown, or not an actor)."""
        from relax.core.weight_sync.base import is_actor
        from relax.core.weight_sync.nodes import actor_node

        try:
            return actor_node(handle) if is_actor(handle) else None
        except Exception as exc:  # Ray going down: no node to wait for
            log.debug("engine node lookup failed: %s", exc)
            return None

    def verdict(self, node: str, stop: threading.Event) -> str:
        """Wait for Ray's verdict on ``node``: "alive" (the driver's own node, or a task pinned to it
        ran), "dead" (Ray declared it dead), or "stopped" (``stop`` was set first). Never a guess: a
        lost node's raylet runs no task, and Ray declares every lost node dead within its health-check
        window."""
        if node == ray.get_runtime_context().get_node_id() and node in alive_nodes():
            return "alive"  # the driver's node lives while the driver does: no probe (one machine)
        return self.probe(node, stop)

    def probe(self, node: str, stop: threading.Event) -> str:
        """:meth:`verdict` by a task pinned to ``node`` (a worker process starts there to answer).

        The probe is never cancelled: a pending one fails by itself when Ray declares its node dead, and
        cancelling it while Ray fails it aborts the driver (Ray 2.60's core worker: "Tried to complete task
        that was not pending", which killed a test session). A node Ray already lists dead gets no probe."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if node not in alive_nodes():
            return "dead"
        probe = ray.remote(num_cpus=0)(
            _probe
        )  # made here: importing this module must not import Ray (lazy_ray)
        ref = probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        while True:
            if node not in alive_nodes():
                return "dead"
            if ref is None:  # the probe failed with its node: wait for ray.nodes() to say so
                if stop.wait(POLL_S):
                    return "stopped"
                continue
            ready, _ = ray.wait([ref], timeout=POLL_S)
            if ready:
                try:
                    ray.get(ready[0])
                    return "alive"
                except Exception:
                    ref = None
            if stop.is_set():
                return "stopped"

    def slot_node(self, slot: int, exclude: str | None = None) -> str | None:
        """The alive node (not ``exclude``) holding engine slot ``slot``'s reservation now; None while
        Ray has not (re)placed it -- its node was lost and no node with the label has room yet."""
        if self.placement is None or not self.placement.groups:
            return None
        import ray.util

        spec = self.placement.plan.engines[slot]
        table = ray.util.placement_group_table(self.placement.groups[spec.group])
        node = (table.get("bundles_to_node_id") or {}).get(spec.bundle)
        if table.get("state") != "CREATED" or node is None or node == exclude or node not in alive_nodes():
            return None
        return node

    def has_reservation(self, slot: int | None) -> bool:
        return slot is not None and self.placement is not None and bool(self.placement.groups)

    def await_slot(
        self,
        slot: int | None,
        exclude: str | None,
        stop: threading.Event,
        waiting: Callable[[], None] = lambda: None,
    ) -> bool:
        """Wait, however long, until ``slot``'s reservation sits on an alive node other than ``exclude``
        (``waiting()`` is called each time it does not yet); True at once for an engine without one,
        False when ``stop`` is set first."""
        while self.has_reservation(slot) and self.slot_node(slot, exclude) is None:
            waiting()
            if stop.wait(POLL_S):
                return False
        return True

    def await_slots(self, slots: dict[int, int | None], timeout_s: float, stop: threading.Event) -> None:
        """Each engine's (index -> slot) reservation on an alive node within ``timeout_s``: else an error
        naming the engine, what it waits for and the command that provides it."""
        deadline = time.monotonic() + timeout_s
        for index, slot in slots.items():
            while self.has_reservation(slot) and self.slot_node(slot) is None:
                if stop.is_set():
                    raise RuntimeError("the run is stopping")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rollout engine[{index}]: the reservation of engine slot {slot} is on no alive "
                        f"node within {timeout_s:g}s; it waits for {self.wants()} (start one with "
                        f"`{self.fix()}`)"
                    )
                time.sleep(POLL_S)

    def wants(self) -> str:
        """What a waiting engine needs, in words: ``a node labelled relax-node=rollout with CPU=1 free``."""
        from relax.core.cluster import NODE_LABEL

        needs = (
            ", ".join(f"{k}={v:g}" for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v > 0) or "CPU=0"
        )
        where = f"a node labelled {NODE_LABEL}={self.label}" if self.label else "a node"
        return f"{where} with {needs} free"

    def fix(self) -> str:
        """The command that would end the wait: a node with the label and the resources joining."""
        from relax.core.cluster import NODE_LABEL

        head = "<head>"
        if ray.is_initialized():  # (asking an uninitialised Ray for its context would start one)
            try:
                head = ray.get_runtime_context().gcs_address
            except Exception as exc:  # Ray going down: the placeholder
                log.debug("head address lookup failed: %s", exc)
        parts = [f"ray start --address={head}"]
        parts += [f"--labels {NODE_LABEL}={self.label}"] if self.label else []
        parts += [f"--num-cpus={max(1, round(self.cpus))}"] if self.cpus > 0 else []
        parts += [f"--num-gpus={round(self.gpus)}"] if self.gpus > 0 else []
        return " ".join(parts)


def for_run(cfg: Any, placement: Any | None) -> EnginePlaces:
    """The run's :class:`EnginePlaces`: its reservation, its rollout label, one engine's resources."""
    from relax.core.cluster import node_of
    from relax.core.controller.contexts import resources_for

    declared = resources_for(cfg, "rollout_engine")
    workers = max(1, declared.num_workers)
    return EnginePlaces(
        placement, node_of(cfg, "rollout"), declared.num_cpus * workers, declared.num_gpus * workers
    )
