"""Reserve what the engines and the trainer declare, with Ray placement groups.

Backends declare ``Resources(num_cpus, num_gpus, num_workers)`` at registration (per engine, per
trainer rank). ``plan`` turns the declarations into placement groups without touching Ray (pure,
unit-tested); ``reserve`` creates them and waits until Ray has granted every bundle.

- ``colocate``: one shared group. Bundle ``b`` hosts trainer rank ``b`` and engine ``b``; it holds
  the larger of the two declarations and each actor requests a share of it, so both fit while they
  take turns (on a GPU, both actors see the same device).
- ``async`` / ``hybrid``: the trainer's ranks get one group (one bundle per rank), every engine its
  own one-bundle group (an engine can be replaced or added without touching the others).

An engine with ``num_workers > 1`` gets one bundle of ``num_workers`` times its per-worker
resources (its workers share a node, e.g. tensor-parallel GPUs of one server). Ray bundles cannot
be empty: a zero declaration reserves a sliver of CPU (``MIN_CPU``) and its actor requests nothing.
Reference, teacher and reward roles keep zero reservations (they are scheduled outside the groups).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from relax.core.cluster import bundle_selectors, placement_shortfalls
from relax.core.context import Resources

log = logging.getLogger("relax")

MIN_CPU = 0.01  # what an all-zero declaration reserves, since Ray rejects empty bundles
DEFAULT_TIMEOUT_S = 120.0  # how long to wait for a cluster to grant the reservation


class PlacementError(RuntimeError):
    """The reservation cannot be (or was not) granted; names the role and what it asked for."""


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: ``group`` / ``bundle`` of the plan and the share of the bundle it requests."""

    group: int
    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class GroupSpec:
    role: str  # "trainer", "rollout[0]", "colocate"
    bundles: tuple[dict[str, float], ...]
    strategy: str = "PACK"
    node: str | None = None  # pinned to nodes with this ``relax-node`` label (``ray.nodes``); None: anywhere


@dataclass(frozen=True)
class Plan:
    groups: tuple[GroupSpec, ...]
    trainer: tuple[Slot, ...]  # one per rank
    engines: tuple[Slot, ...]  # one per engine

    def total(self) -> dict[str, float]:
        """Sum of every bundle: what the run takes from the cluster."""
        out: dict[str, float] = {}
        for g in self.groups:
            for b in g.bundles:
                for k, v in b.items():
                    out[k] = out.get(k, 0.0) + v
        return out


def _per_engine(r: Resources) -> tuple[float, float]:
    n = max(1, r.num_workers)
    return r.num_cpus * n, r.num_gpus * n


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    return bundle or {"CPU": MIN_CPU}


def plan(
    mode: str, trainer: Resources, engine: Resources, num_engines: int, nodes: dict[str, str] | None = None
) -> Plan:
    """The placement groups for a run (see the module docstring); ``nodes``: role -> node label
    (``ray.nodes``: ``trainer`` pins the trainer's group, ``rollout`` every engine's, colocate's shared one)."""
    nodes = nodes or {}
    ranks = max(1, trainer.num_workers)
    t = (trainer.num_cpus, trainer.num_gpus)
    e = _per_engine(engine)
    if mode == "colocate":
        bundles, trainer_slots, engine_slots = [], [], []
        for b in range(max(ranks, num_engines)):
            decl = ([t] if b < ranks else []) + ([e] if b < num_engines else [])
            cap = (max(d[0] for d in decl), max(d[1] for d in decl))
            bundles.append(_bundle(*cap))
            share = [_shares(cap, decl, i) for i in range(len(decl))]
            if b < ranks:
                trainer_slots.append(Slot(0, b, *share[0]))
            if b < num_engines:
                engine_slots.append(Slot(0, b, *share[-1]))
        shared = GroupSpec("colocate", tuple(bundles), node=nodes.get("trainer") or nodes.get("rollout"))
        return Plan((shared,), tuple(trainer_slots), tuple(engine_slots))
    groups = [GroupSpec("trainer", tuple(_bundle(*t) for _ in range(ranks)), node=nodes.get("trainer"))]
    groups += [
        GroupSpec(f"rollout[{i}]", (_bundle(*e),), "STRICT_PACK", node=nodes.get("rollout"))
        for i in range(num_engines)
    ]
    return Plan(
        tuple(groups),
        tuple(Slot(0, r, *t) for r in range(ranks)),
        tuple(Slot(1 + i, 0, *e) for i in range(num_engines)),
    )


def _shares(cap: tuple[float, float], decl: list[tuple[float, float]], i: int) -> tuple[float, float]:
    """Actor ``i``'s request on a shared bundle: its declaration scaled so the requests sum to ``cap``
    at most (each resource kind separately)."""
    out = []
    for k in range(2):
        total = sum(d[k] for d in decl)
        out.append(0.0 if total == 0 else decl[i][k] * min(1.0, cap[k] / total))
    return out[0], out[1]


def plan_for(cfg: Any) -> Plan:
    """``plan`` from the run config, with what the configured backends declare."""
    from relax.core.controller.contexts import resources_for

    return plan(
        cfg.mode,
        resources_for(cfg, "trainer"),
        resources_for(cfg, "rollout_engine"),
        cfg.rollout.num_engines,
        nodes=cfg.ray.nodes,
    )


def required_cpus(cfg: Any) -> int:
    """Logical CPUs an embedded Ray needs for this config's reservation (rounded up)."""
    return math.ceil(plan_for(cfg).total().get("CPU", 0.0) - 1e-9)


@dataclass
class Placement:
    """The run's granted placement groups; ``remove`` releases them (idempotent)."""

    plan: Plan
    groups: list[Any]
    names: list[str] = field(default_factory=list)

    def options(self, slot: Slot) -> dict[str, Any]:
        """Ray actor options that run an actor on ``slot``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": slot.num_cpus,
            "num_gpus": slot.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[slot.group], placement_group_bundle_index=slot.bundle
            ),
        }

    def trainer_options(self) -> list[dict[str, Any]]:
        return [self.options(s) for s in self.plan.trainer]

    def engine_options(self, index: int) -> dict[str, Any]:
        return self.options(self.plan.engines[index])

    def node_ids(self, slots: tuple[Slot, ...] | list[Slot]) -> list[str]:
        """The Ray node id hosting each slot's bundle."""
        import ray.util

        tables = {}
        out = []
        for s in slots:
            if s.group not in tables:
                tables[s.group] = ray.util.placement_group_table(self.groups[s.group])["bundles_to_node_id"]
            out.append(tables[s.group][s.bundle])
        return out

    def remove(self) -> None:
        from ray.util import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # Ray already gone: nothing is held any more
                log.debug("placement group removal failed: %s", exc)
        self.groups = []


def describe(spec: GroupSpec) -> str:
    kinds = sorted({k for b in spec.bundles for k in b})
    per = ", ".join(f"{k}={spec.bundles[0].get(k, 0):g}" for k in kinds)
    if all(b == spec.bundles[0] for b in spec.bundles):
        return f"{spec.role}: {len(spec.bundles)} bundle(s) of {{{per}}}"
    return f"{spec.role}: bundles {list(spec.bundles)}"


def reserve(
    p: Plan, *, timeout_s: float = DEFAULT_TIMEOUT_S, fixed_cluster: bool = False, run_name: str = "relax"
) -> Placement:
    """Create ``p``'s placement groups and wait until all are granted.

    ``fixed_cluster`` (an embedded Ray, whose resources never grow): a request larger than the
    cluster's total fails at once instead of after ``timeout_s``. On failure nothing stays reserved.
    """
    import ray
    from ray.util.placement_group import placement_group

    if fixed_cluster:
        have = ray.cluster_resources()
        short = {k: v for k, v in p.total().items() if v > have.get(k, 0.0) + 1e-9}
        if short:
            asks = "; ".join(describe(g) for g in p.groups)
            raise PlacementError(
                f"the run reserves {_fmt(p.total())} but this Ray instance has {_fmt(have, keys=short)} "
                f"({asks}); lower num_cpus/num_gpus/world_size in trainer.backend_params or "
                "rollout.engine_params, or raise ray.num_cpus"
            )
    check_pinned(p)
    tag = f"{run_name}:{uuid.uuid4().hex[:8]}"
    placement = Placement(p, [], [])
    try:
        for spec in p.groups:
            name = f"relax:{tag}:{spec.role}"
            selectors = bundle_selectors(spec.node, len(spec.bundles))
            extra = {"bundle_label_selector": selectors} if selectors else {}
            placement.groups.append(
                placement_group(list(spec.bundles), strategy=spec.strategy, name=name, **extra)
            )
            placement.names.append(name)
        deadline = time.monotonic() + timeout_s
        for spec, pg in zip(p.groups, placement.groups, strict=True):
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise PlacementError(
                    f"placement: Ray did not grant {describe(spec)} within {timeout_s:g}s "
                    f"(cluster total {_fmt(ray.cluster_resources())}, available now "
                    f"{_fmt(ray.available_resources())}); add nodes or lower the role's num_cpus/num_gpus"
                )
    except BaseException:
        placement.remove()
        raise
    return placement


def check_pinned(p: Plan) -> None:
    """Groups pinned to node labels (``ray.nodes``) must fit on the alive nodes with that label now:
    otherwise a ``PlacementError`` naming each role, its label and what is missing (not a timeout)."""
    if not any(spec.node for spec in p.groups):
        return
    import ray

    merged: dict[str, tuple[str | None, list[dict[str, float]]]] = {}
    for spec in p.groups:  # every engine's group counts against the rollout nodes together
        role = "rollout engines" if spec.role.startswith("rollout[") else spec.role
        node, bundles = merged.get(role, (spec.node, []))
        merged[role] = (node, [*bundles, *spec.bundles])
    if problems := placement_shortfalls([(r, n, b) for r, (n, b) in merged.items()], ray.nodes()):
        raise PlacementError("placement: the run cannot be placed: " + "; ".join(problems))


def _fmt(res: dict[str, float], keys: Any = ("CPU", "GPU")) -> str:
    return "{" + ", ".join(f"{k}={res.get(k, 0):g}" for k in keys) + "}"
