"""Built-in algorithm tables, their declared needs, and lookup through the process-wide plugin registry.

Lookups go through ``relax.core.plugins.get_plugin_manager()`` so names registered by plugins
(``relax_register_algorithms``) work everywhere; the built-in tables are the fallback only when
the plugin manager cannot be imported. Built-ins declare ``needs`` / ``modes`` exactly as a
plugin does (``relax.core.algorithm_needs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.core.algorithm_needs import MODES, AlgorithmSpec, run_needs
from relax.core.algorithms import advantages as adv
from relax.core.algorithms import (
    distillation,
    group_advantages,
    policy_losses,
    token_baselines,
    trust_region_losses,
)
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
    "gdpo": group_advantages.gdpo,
    "optimal_token_baseline": token_baselines.optimal_token_baseline,
    "tir_optimal_token_baseline": token_baselines.tir_optimal_token_baseline,
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
    "dro": policy_losses.dro,
}

_BUILTIN = {"advantage": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES, "kl": KL_ESTIMATORS}

_GROUPS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "gdpo")
_RATIO_LOSSES = (
    "ppo",
    "gspo",
    "sapo",
    "cispo",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_binary_kl",
    "m2po",
    "dro",
)
#: (kind, name) -> what the built-in consumes (names not listed need nothing beyond the policy's logprobs)
BUILTIN_NEEDS: dict[tuple[str, str], frozenset[str]] = {
    ("advantage", "gae"): frozenset({"values"}),
    ("advantage", "reinforce_plus_plus"): frozenset({"kl"}),
    ("advantage", "remax"): frozenset({"greedy_baseline"}),
    **{("advantage", n): frozenset({"groups"}) for n in _GROUPS},
    **{
        ("advantage", n): frozenset({"groups", "old_logprobs", "sum_pi_squared"})
        for n in ("optimal_token_baseline", "tir_optimal_token_baseline")
    },
    **{("policy_loss", n): frozenset({"old_logprobs"}) for n in _RATIO_LOSSES},
    ("policy_loss", "opd"): frozenset({"teacher", "old_logprobs"}),
}
#: (kind, name) -> the modes a built-in supports, where not all (the greedy probe re-generates within a step)
BUILTIN_MODES: dict[tuple[str, str], frozenset[str]] = {("advantage", "remax"): frozenset({"colocate"})}


def builtin_spec(kind: str, name: str) -> AlgorithmSpec:
    table = _BUILTIN[kind]
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; built-in {kind} names: {sorted(table)}")
    key = (kind, name)
    return AlgorithmSpec(
        kind, name, table[name], BUILTIN_NEEDS.get(key, frozenset()), BUILTIN_MODES.get(key, frozenset(MODES))
    )


def register_builtin_algorithms(register: Callable[..., None]) -> None:
    """Body of core's ``relax_register_algorithms`` hook: registers every built-in by name, with
    its ``needs`` / ``modes``."""
    for kind, table in _BUILTIN.items():
        for name in table:
            spec = builtin_spec(kind, name)
            register(name, spec.fn, kind=kind, needs=spec.needs, modes=spec.modes)


def _manager():
    try:
        from relax.core.plugins import get_plugin_manager
    except ImportError:
        return None
    return get_plugin_manager()


def algorithm_spec(kind: str, name: str) -> AlgorithmSpec:
    """The registered function with its declarations; ``KeyError`` for an unknown name."""
    manager = _manager()
    if manager is None:
        return builtin_spec(kind, name)
    reg = manager.registration(kind, name)
    return AlgorithmSpec(
        kind,
        name,
        reg.factory,
        frozenset(reg.options.get("needs", ())),
        frozenset(reg.options.get("modes", MODES)),
        reg.plugin,
    )


def algorithm_specs(kind: str) -> list[AlgorithmSpec]:
    """Every registered algorithm of ``kind``, sorted by name."""
    return [algorithm_spec(kind, name) for name in names(kind)]


def config_needs(algorithm: Any) -> frozenset[str]:
    """What a run's ``algorithm`` config consumes: the chosen estimator's and loss's declared
    needs plus what its switches add (``kl.coef > 0``: reference, ``opd_coef > 0``: teacher). The
    controller starts roles from this set; it never looks at algorithm names."""
    return run_needs(
        algorithm_spec("advantage", algorithm.advantage_estimator),
        algorithm_spec("policy_loss", algorithm.policy_loss),
        algorithm,
    )


def declared_by(algorithm: Any, need: str) -> list[str]:
    """The config fields whose chosen algorithm declares ``need``, as ``field='name'`` (start-up
    errors name them); unregistered names are skipped (the config loader reports those)."""
    fields = {
        "advantage": ("algorithm.advantage_estimator", algorithm.advantage_estimator),
        "policy_loss": ("algorithm.policy_loss", algorithm.policy_loss),
    }
    out = []
    for kind, (field, name) in fields.items():
        try:
            if need in algorithm_spec(kind, name).needs:
                out.append(f"{field}={name!r}")
        except KeyError:
            continue
    return out


def lookup(kind: str, name: str) -> Callable[..., Any]:
    return algorithm_spec(kind, name).fn


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
