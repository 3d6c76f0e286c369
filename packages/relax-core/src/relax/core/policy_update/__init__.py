"""Core's policy-update loop: one ``train_step`` skeleton for every trainer backend.

``PolicyUpdate`` (the loop), ``ModelStep`` (what a backend supplies), ``UpdateSettings`` (the shared
optimisation settings), and the row / schedule helpers backends reuse.
"""

from relax.core.policy_update.backend import LossFn, ModelStep
from relax.core.policy_update.batching import (
    even_replica_rows,
    replica_rows,
    shard_bounds,
    split_rows,
    take_rows,
)
from relax.core.policy_update.loop import NonFiniteError, Objective, PolicyUpdate
from relax.core.policy_update.schedule import LR_SCHEDULES, check_schedule, lr_factor
from relax.core.policy_update.settings import UpdateSettings

__all__ = [
    "LR_SCHEDULES",
    "LossFn",
    "ModelStep",
    "NonFiniteError",
    "Objective",
    "PolicyUpdate",
    "UpdateSettings",
    "check_schedule",
    "even_replica_rows",
    "lr_factor",
    "replica_rows",
    "shard_bounds",
    "split_rows",
    "take_rows",
]
