"""Inputs built on first use (``inputs.name``, ``relax_register_inputs``): a plugin's example runs from a
fresh clone as the quick-start does, its model and data made where the config leaves the paths null."""

from __future__ import annotations

import copy
from typing import Any

from relax.core.context import PluginContext
from relax.core.plugins import get_plugin_manager


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def fill_inputs(cfg: Any, data: dict[str, Any]) -> dict[str, Any] | None:
    """``data`` (the config as loaded) with the selected plugin's generated values in the fields it
    ``fills`` that are null; None when there is nothing to fill (no ``inputs.name``, or every field set)."""
    if cfg.inputs.name is None:
        return None
    reg = get_plugin_manager().registration("inputs", cfg.inputs.name)
    unset = [f for f in reg.options.get("fills", ()) if _get(data, f) is None]
    if not unset:
        return None
    made = reg.factory(cfg.inputs.params, PluginContext(role="inputs", run_dir=cfg.run_dir, seed=cfg.seed))
    missing = [f for f in unset if f not in made]
    if missing:
        raise ValueError(
            f"inputs {cfg.inputs.name!r} declared it fills {missing} but returned no value for them"
        )
    filled = copy.deepcopy(data)
    for field_path in unset:
        _set(filled, field_path, str(made[field_path]))
    return filled
