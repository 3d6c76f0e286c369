"""Entry point of relax-rewards: registers the hub's rewards with relax-core.

Each reward has a typed params dataclass (``reward.params``). Rewards that run math-verify or the
IFEval checkers, and ``genrm``, run through a one-route hub even when selected alone, so they are
isolated and time-bounded the same way; the hub builds its components from ``component=`` (the bare
reward) instead. Every reward that needs no engine handle or network session declares ``in_driver=True``:
scored in the driver like core's rule rewards (its hub's process pool, when isolated, is started from there),
so a run with one of them needs no reward actor -- and, colocated, no Ray at all.
"""

from __future__ import annotations

from typing import Any

from relax.core.hookspecs import hookimpl
from relax.rewards.choice import ChoiceParams
from relax.rewards.dapo import DapoParams
from relax.rewards.genrm import GenRMParams
from relax.rewards.hub import HubParams
from relax.rewards.ifeval import IFEvalParams
from relax.rewards.mathverify import MathParams
from relax.rewards.openr1 import OpenR1Params
from relax.rewards.remote import RemoteParams
from relax.rewards.squad import SquadParams


def _function(path: str) -> Any:
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"relax.rewards.{module}"), name)


def _local(fn: str, warm: str | None = None):
    """Builder of a LocalReward around ``relax.rewards.<fn>`` (imported when built, not when registered)."""

    def build(params: Any, ctx: Any = None) -> Any:
        from relax.rewards.local import LocalReward

        return LocalReward(_function(fn), params, _function(warm) if warm else None)

    return build


def _isolated(name: str):
    """Factory for ``reward.name: <name>`` alone: a one-route hub around it."""

    def build(params: Any, ctx: Any = None) -> Any:
        from relax.rewards.hub import single

        return single(name, params, ctx)

    return build


def _hub(params: HubParams, ctx: Any = None) -> Any:
    from relax.rewards.hub import Hub

    return Hub(params, ctx)


def _remote(params: RemoteParams, ctx: Any = None) -> Any:
    from relax.rewards.remote import RemoteReward

    return RemoteReward(params, ctx)


def _genrm(params: GenRMParams, ctx: Any = None) -> Any:
    from relax.rewards.genrm import GenRMReward

    return GenRMReward(params, ctx)


@hookimpl
def relax_register_rewards(register):
    register("hub", _hub, config=HubParams)
    for name, fn, warm, config in (
        ("math", "mathverify.math_score", "mathverify.warm_math", MathParams),
        ("openr1_mm", "openr1.openr1_score", "mathverify.warm_math", OpenR1Params),
        ("ifeval", "ifeval.ifeval_score", "ifeval.warm_ifeval", IFEvalParams),
        ("ifbench", "ifeval.ifbench_score", "ifeval.warm_ifeval", IFEvalParams),
    ):
        register(name, _isolated(name), config=config, component=_local(fn, warm), in_driver=True)
    for name, fn, config in (
        ("dapo", "dapo.dapo_score", DapoParams),
        ("multiple_choice", "choice.choice_score", ChoiceParams),
        ("gpqa", "choice.choice_score", ChoiceParams),
        ("f1", "squad.f1_score", SquadParams),
        ("exact_match_squad", "squad.em_score", SquadParams),
    ):
        register(name, _local(fn), config=config, in_driver=True)
    register("remote", _remote, config=RemoteParams)
    register("genrm", _isolated("genrm"), config=GenRMParams, component=_genrm)


# the text math recipes (DAPO-Math GRPO / PPO), with the reward they train on (relax.rewards.recipes)
@hookimpl
def relax_register_datasets(register):
    from relax.rewards.recipes import register_datasets

    register_datasets(register)


@hookimpl
def relax_register_recipes(register):
    from relax.rewards.recipes import register_recipes

    register_recipes(register)


@hookimpl
def relax_register_inputs(register):
    from relax.rewards.recipes import register_inputs

    register_inputs(register)
