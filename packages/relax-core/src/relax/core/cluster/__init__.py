"""Running across Ray nodes: which node each role may run on, and whether it can be placed there.

A role is pinned to nodes by a label: ``ray.nodes: {trainer: train, rollout: rollout}`` runs the
trainer's ranks only on nodes started with ``ray start --labels relax-node=train`` and every rollout
engine (replacements and engines added at run time included) on ``relax-node=rollout`` nodes. The
placement groups carry the label as a bundle label selector, so Ray itself enforces it; before
reserving, :func:`placement_shortfalls` compares what each pinned role asks with the nodes that
carry its label *now*, so a run that cannot be placed says which role, which label and which
resources are missing instead of waiting for a grant that never comes. Nothing here imports Ray at
module import (``relax validate`` uses the config checks alone).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

#: the node label that ``ray.nodes`` values match (``ray start --labels relax-node=<value>``)
NODE_LABEL = "relax-node"
#: roles that can be pinned; ``rollout`` covers every engine of the run
PINNABLE = ("trainer", "rollout", "reward", "reference", "teacher")


def pin_errors(cfg: Any) -> list[str]:
    """Config-only problems of ``ray.nodes`` (shared by ``relax validate`` and ``relax run``)."""
    nodes = cfg.ray.nodes or {}
    errors = [
        f"ray.nodes.{role}: unknown role; pinnable roles: {', '.join(PINNABLE)}"
        for role in nodes
        if role not in PINNABLE
    ]
    errors += [
        f"ray.nodes.{role}: expected a node label value (a non-empty string), got {value!r}"
        for role, value in nodes.items()
        if not isinstance(value, str) or not value.strip()
    ]
    if (
        cfg.mode == "colocate"
        and nodes.get("trainer") != nodes.get("rollout")
        and {"trainer", "rollout"} & set(nodes)
    ):
        errors.append(
            f"ray.nodes: mode 'colocate' shares one placement group between trainer and rollout, so they "
            f"must be pinned to the same nodes; got trainer={nodes.get('trainer')!r}, rollout={nodes.get('rollout')!r}"
        )
    return errors


def driver_paths(cfg: Any) -> Any:
    """``cfg`` with its relative paths (``run_dir``, ``model.path``, ``data.path``, a
    ``checkpoint.resume`` directory) made absolute against the driver's current directory, as the
    config loader checked them. The roles that read and write them run in other processes, on other
    nodes, whose current directory is their node's (where ``ray start`` ran), never the driver's."""

    def absolute(value: str | None) -> str | None:
        return value if value is None or os.path.isabs(value) else os.path.abspath(value)

    resume = cfg.checkpoint.resume
    return replace(
        cfg,
        run_dir=absolute(cfg.run_dir),
        model=replace(cfg.model, path=absolute(cfg.model.path)),
        data=replace(cfg.data, path=absolute(cfg.data.path)),
        checkpoint=replace(
            cfg.checkpoint, resume=resume if resume in ("auto", "never") else absolute(resume)
        ),
    )


def node_of(cfg: Any, role: str) -> str | None:
    """The label value ``role`` is pinned to (None: any node)."""
    return (cfg.ray.nodes or {}).get(role)


def actor_options(cfg: Any, role: str) -> dict[str, Any]:
    """Ray actor options that keep an actor of ``role`` (outside any placement group) on its nodes."""
    node = node_of(cfg, role)
    return {"label_selector": {NODE_LABEL: node}} if node else {}


def bundle_selectors(node: str | None, n: int) -> list[dict[str, str]] | None:
    """``placement_group(..., bundle_label_selector=...)`` for ``n`` bundles on ``node`` (None: anywhere)."""
    return [{NODE_LABEL: node}] * n if node else None


def placement_shortfalls(
    groups: list[tuple[str, str | None, list[dict[str, float]]]], nodes: list[dict[str, Any]]
) -> list[str]:
    """Why pinned groups cannot be placed on the cluster's alive ``nodes`` (``ray.nodes()`` rows), one
    line per role; pure. ``groups``: (role, label value or None, bundles). Bundles of one role must
    each fit on some node with its label, and all of them together on those nodes' total."""
    problems = []
    alive = [n for n in nodes if n.get("Alive")]
    for role, node, bundles in groups:
        if node is None:
            continue
        matching = [n for n in alive if (n.get("Labels") or {}).get(NODE_LABEL) == node]
        if not matching:
            seen = sorted({(n.get("Labels") or {}).get(NODE_LABEL, "-") for n in alive})
            problems.append(
                f"{role}: pinned to nodes labelled {NODE_LABEL}={node}, but no alive node has that label "
                f"(labels present: {', '.join(seen)}); start one with `ray start --labels {NODE_LABEL}={node}`"
            )
            continue
        totals: dict[str, float] = {}
        for n in matching:
            for k, v in (n.get("Resources") or {}).items():
                totals[k] = totals.get(k, 0.0) + v
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0.0) + v
        biggest = {k: max((n.get("Resources") or {}).get(k, 0.0) for n in matching) for k in need}
        lines = [
            f"{k}={v:g} in all (those nodes have {totals.get(k, 0.0):g})"
            for k, v in sorted(need.items())
            if v > totals.get(k, 0.0) + 1e-9
        ]
        lines += [
            f"a bundle of {k}={size:g} (the largest such node has {biggest[k]:g})"
            for k in sorted(need)
            if (size := max(b.get(k, 0.0) for b in bundles)) > biggest[k] + 1e-9
        ]
        if lines:
            problems.append(
                f"{role}: needs {'; '.join(lines)} on nodes labelled {NODE_LABEL}={node} "
                f"({len(matching)} alive)"
            )
    return problems
