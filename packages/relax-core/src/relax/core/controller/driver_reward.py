"""A reward that declares it can run in the driver is scored there: one process fewer to start.

Rule rewards (core's ``numeric`` and ``exact_match``, or any plugin's registered with
``in_driver=True``) are pure Python costing microseconds per sample; a reward actor for them costs a
process that imports torch and Ray's worker at start-up -- on a 2-core machine, seconds taken from
the trainer's own start, and with every role in the driver a run needs no Ray at all
(``controller.hosting``). The same ``RewardRole`` code runs in the driver behind the same call shape
(``handle.score.remote(samples)``, resolved by ``controller.local.get``), so the modes and stages
need no special case. Timeouts hold as in the actor: scoring runs on ``rewards.runner.ScoringLoop``
(a daemon loop; a hung call is abandoned, never awaited). Any other reward (judges, remote models,
anything not declared) keeps its own actor.
"""

from __future__ import annotations

from typing import Any

from relax.core.controller.hosting import reward_in_driver
from relax.core.controller.roles import RewardRole
from relax.core.lazy_ray import LocalHandle


def start_reward(cfg: Any, ctx: Any) -> Any:
    """The reward role: in the driver for a reward declared ``in_driver`` (``RewardRole``'s code
    behind a :class:`~relax.core.lazy_ray.LocalHandle`), else its own actor."""
    from relax.core.cluster import actor_options, node_of

    if reward_in_driver(cfg) and node_of(cfg, "reward") is None:  # a pinned reward runs on its nodes
        return LocalHandle(RewardRole.__ray_actor_class__(cfg, ctx))
    return RewardRole.options(num_cpus=0, **actor_options(cfg, "reward")).remote(cfg, ctx)
