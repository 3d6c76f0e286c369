"""Built-in algorithm tables and name lookup through the process-wide plugin registry.

Lookups go through ``relax.core.plugins.get_plugin_manager()`` so names registered by plugins
(``relax_register_algorithms``) work everywhere; the built-in tables are the fallback only when
the plugin manager cannot be imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.core.algorithms import advantages as adv
from relax.core.algorithms import distillation, group_advantages, policy_losses, trust_region_losses
from relax.core.algorithms.kl import KL_ESTIMATORS

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "gae": adv.gae,
    "grpo": group_advantages.grpo,
    "dr_grpo": group_advantages.dr_grpo,
    "rloo": group_advantages.rloo,
    "reinforce_plus_plus": adv.reinforce_plus_plus,
    "reinforce_plus_plus_baseline": group_advantages.reinforce_plus_plus_baseline,
    "opo": group_advantages.opo,
    "gpg": group_advantages.gpg,
    "remax": adv.remax,
    "grpo_passk": group_advantages.grpo_passk,
}

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo": policy_losses.ppo,
    "gspo": policy_losses.gspo,
    "sapo": policy_losses.sapo,
    "cispo": policy_losses.cispo,
    "gpg": policy_losses.gpg,
    "reinforce": policy_losses.reinforce,
    "gmpo": policy_losses.gmpo,
    "clip_cov": trust_region_losses.clip_cov,
    "kl_cov": trust_region_losses.kl_cov,
    "dppo_tv": trust_region_losses.dppo_tv,
    "dppo_binary_kl": trust_region_losses.dppo_binary_kl,
    "m2po": trust_region_losses.m2po,
    "opd": distillation.opd,
}

_BUILTIN = {"advantage": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES, "kl": KL_ESTIMATORS}


def register_builtin_algorithms(register: Callable[..., None]) -> None:
    """Body of core's ``relax_register_algorithms`` hook: registers every built-in by name."""
    for kind, table in _BUILTIN.items():
        for name, fn in table.items():
            register(name, fn, kind=kind)


def _manager():
    try:
        from relax.core.plugins import get_plugin_manager
    except ImportError:
        return None
    return get_plugin_manager()


def lookup(kind: str, name: str) -> Callable[..., Any]:
    manager = _manager()
    if manager is not None:
        return manager.get(kind, name)
    table = _BUILTIN[kind]
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; built-in {kind} names: {sorted(table)}")
    return table[name]


def names(kind: str) -> list[str]:
    manager = _manager()
    return manager.names(kind) if manager is not None else sorted(_BUILTIN[kind])


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    return lookup("advantage", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    return lookup("policy_loss", name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    return lookup("kl", name)


def list_advantage_estimators() -> list[str]:
    return names("advantage")


def list_policy_losses() -> list[str]:
    return names("policy_loss")


def list_kl_estimators() -> list[str]:
    return names("kl")
