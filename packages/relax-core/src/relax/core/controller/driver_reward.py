"""Built-in rewards scored in the driver: one process fewer to start on a local run.

The built-in rule rewards (``numeric``, ``exact_match``) are pure Python costing microseconds per
sample; a reward actor for them costs a process that imports torch and Ray's worker at start-up --
on a 2-core machine, seconds taken from the trainer's own start. The same ``RewardRole`` code runs in
the driver behind the same call shape (``handle.score.remote(samples)``, resolved by
``controller.local.get``), so the modes and stages need no special case. Timeouts hold as in the
actor: scoring runs on ``rewards.runner.ScoringLoop`` (a daemon loop; a hung call is abandoned,
never awaited). Any other reward (plugins, judges, remote models) keeps its own actor.
"""

from __future__ import annotations

from typing import Any

from relax.core.controller.local import LocalHandle
from relax.core.controller.roles import RewardRole

#: registered names of core's in-process rule rewards (registry names are unique, so these are core's)
DRIVER_REWARDS = frozenset({"numeric", "exact_match"})


def start_reward(cfg: Any, ctx: Any) -> Any:
    """The reward role: in the driver for a built-in rule reward (``RewardRole``'s code behind a
    :class:`~relax.core.controller.local.LocalHandle`), else its own actor."""
    if cfg.reward.name in DRIVER_REWARDS:
        return LocalHandle(RewardRole.__ray_actor_class__(cfg, ctx))
    return RewardRole.options(num_cpus=0).remote(cfg, ctx)
