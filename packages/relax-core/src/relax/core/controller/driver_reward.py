"""Built-in rewards scored in the driver: one process fewer to start on a local run.

The built-in rule rewards (``numeric``, ``exact_match``) are pure Python costing microseconds per
sample; a reward actor for them costs a process that imports torch and Ray's worker at start-up --
on a 2-core machine, seconds taken from the trainer's own start. :class:`DriverReward` runs the same
``RewardRole`` code in the driver behind the same call shape (``handle.score.remote(samples)``
gives an ``ObjectRef``), so the modes and stages need no special case. Timeouts hold as in the
actor: scoring runs on ``rewards.runner.ScoringLoop`` (a daemon loop; a hung call is abandoned,
never awaited). Any other reward (plugins, judges, remote models) keeps its own actor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from relax.core.controller.roles import RewardRole

#: registered names of core's in-process rule rewards (registry names are unique, so these are core's)
DRIVER_REWARDS = frozenset({"numeric", "exact_match"})


class _Method:
    """``.remote(*args)``: call now, in this process; the result as an object-store reference."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return ray.put(self.fn(*args))


class DriverReward:
    """``RewardRole``'s behaviour in the driver, called like its actor handle."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        role = RewardRole.__ray_actor_class__(cfg, ctx)
        self.score = _Method(role.score)
        self.set_engines = _Method(role.set_engines)
        self.capabilities = _Method(role.capabilities)
        self.__ray_ready__ = _Method(lambda: True)


def start_reward(cfg: Any, ctx: Any) -> Any:
    """The reward role: in the driver for a built-in rule reward, else its own actor."""
    if cfg.reward.name in DRIVER_REWARDS:
        return DriverReward(cfg, ctx)
    return RewardRole.options(num_cpus=0).remote(cfg, ctx)
