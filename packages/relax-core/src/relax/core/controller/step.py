"""``StepContext``: everything a mode step (colocate, async, hybrid) reads and writes, typed.

``RunState`` (``controller.run``) is the one implementation; the steps and ``controller.recovery``
depend on this Protocol only, so they read without knowing how the run was set up (Ray or not,
where each role lives) and import nothing above them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from relax.core.checkpoint import CheckpointManager
    from relax.core.config import RelaxConfig
    from relax.core.controller.fleet import EngineFleet
    from relax.core.controller.pipeline import Pipeline
    from relax.core.controller.prompts import PromptSource
    from relax.core.controller.runtime import Roles


class StepContext(Protocol):
    cfg: RelaxConfig
    roles: Roles  # trainer, reference, teacher, reward handles (actors or in-driver objects)
    fleet: EngineFleet  # the rollout engines: routing, control calls, weight sync
    prompts: PromptSource
    pad_id: int
    stop_token_ids: list[int]
    turns: Any  # relax.core.agentic.Turns: every sample an episode (environment.name), or None
    step: int  # the last committed step
    version: int  # the trainer's weight version (advances with each trained step)
    pipeline: Pipeline | None  # async/hybrid: producer and queue roles, started by the first step
    train_inflight: tuple[Any, int] | None  # (ref, step) while a train step runs (controller.recovery)
    checkpoints: CheckpointManager
    fused_old_logprobs: bool | None  # colocate: old logprobs come from the update itself (asked once)
    failures: (
        Any  # relax.core.failures.FailureLog: each step's samples' failures reported (and the rate checked)
    )

    def end_step(self, metrics: dict[str, float]) -> None:
        """Log the step's metrics, call ``relax_on_step_end``, checkpoint every ``save_every``."""
        ...

    def save_checkpoint(self) -> Path: ...
