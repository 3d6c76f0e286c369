"""Which Ray node each side of a transport runs on, and the check that a one-machine transport is
not asked to cross machines.

A transport declares its reach (``Transport.reach``): ``cluster`` (any nodes: ``object_store``,
``broadcast``, ``in_process`` through Ray), ``host`` (sender and receivers on one machine:
``shared_memory`` maps one file of the trainer's ``/dev/shm``), or ``shared_path`` (a directory every
node must see: ``disk``, checked with a probe file by the transport itself). A ``host`` transport
between different nodes is refused before any byte moves, naming both ends and what to use instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from relax.core.weight_sync.base import WeightSyncError, engine_names, is_actor

log = logging.getLogger("relax")

_NODES: dict[str, str] = {}  # actor id -> node id (an actor never moves; a replacement has a new id)
_ADDRESSES: dict[str, str] = {}  # node id -> its IP address
_LOCK = threading.Lock()


def actor_node(handle: Any) -> str | None:
    """The Ray node id an actor runs on (None: not scheduled yet, or not known)."""
    actor_id = handle._actor_id.hex()
    with _LOCK:
        if actor_id in _NODES:
            return _NODES[actor_id]
    try:
        from ray._private.state import actors  # no public API without the dashboard

        node = ((actors(actor_id=actor_id) or {}).get("Address") or {}).get("NodeID") or None
    except Exception as exc:  # Ray's state API moved: skip the check rather than fail the sync
        log.debug("actor node lookup failed: %s", exc)
        return None
    if node and set(node) != {"0"}:
        with _LOCK:
            _NODES[actor_id] = node
        return node
    return None


def node_address(node_id: str | None) -> str | None:
    """The IP address of Ray node ``node_id`` (None: unknown); what an operator recognises a node by."""
    if node_id is None:
        return None
    with _LOCK:
        if node_id in _ADDRESSES:
            return _ADDRESSES[node_id]
    import ray

    found = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}
    with _LOCK:
        _ADDRESSES.update(found)
    return found.get(node_id)


def this_node() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def check_same_host(name: str, trainer: Any, engines: list[Any]) -> None:
    """Refuse a one-machine transport whose trainer and engines run on different Ray nodes."""
    import sys

    if "ray" not in sys.modules:  # no Ray in this process: everything is local
        return
    trainer_node = actor_node(trainer) if is_actor(trainer) else this_node()
    if trainer_node is None:
        return
    elsewhere = [
        label
        for label, engine in zip(engine_names(engines), engines, strict=True)
        if (actor_node(engine) if is_actor(engine) else this_node()) not in (None, trainer_node)
    ]
    if elsewhere:
        raise WeightSyncError(
            f"weight_sync.transport {name!r} works on one machine only, but {', '.join(elsewhere)} run(s) on another "
            f"Ray node than the trainer (node {trainer_node[:12]}); use object_store or broadcast across nodes, "
            "or pin trainer and rollout to the same nodes (ray.nodes)"
        )
