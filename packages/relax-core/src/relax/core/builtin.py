"""Core's built-in plugin: registers the CPU backends through the same hooks as any plugin.

Factories import their modules lazily so that ``relax plugins`` stays fast.
"""

from __future__ import annotations

from typing import Any

from relax.core.hookspecs import hookimpl


def _hf_engine(cfg: Any, model_path: str):
    from relax.core.engines.hf import HFRolloutEngine

    return HFRolloutEngine(model_path, dtype=cfg.model.dtype, **cfg.rollout.engine_params)


def _torch_trainer(cfg: Any, model_path: str, reference: bool = False):
    from relax.core.trainers.torch_trainer import trainer_from_config

    return trainer_from_config(cfg, model_path, reference=reference)


def _numeric_reward(**params: Any):
    from relax.core.rewards.numeric import NumericReward

    return NumericReward(**params)


def _exact_match_reward(**params: Any):
    from relax.core.rewards.exact_match import ExactMatchReward

    return ExactMatchReward(**params)


@hookimpl
def relax_register_rollout_engines(register):
    register("hf", _hf_engine)


@hookimpl
def relax_register_trainers(register):
    register("torch", _torch_trainer)


@hookimpl
def relax_register_rewards(register):
    register("numeric", _numeric_reward)
    register("exact_match", _exact_match_reward)


@hookimpl
def relax_register_algorithms(register):
    from relax.core.algorithms import register_builtin_algorithms

    register_builtin_algorithms(register)


@hookimpl
def relax_register_weight_syncs(register):
    from relax.core.weight_sync import register_builtin_weight_syncs

    register_builtin_weight_syncs(register)


@hookimpl
def relax_register_queues(register):
    from relax.core.queue import register_builtin_queues

    register_builtin_queues(register)
