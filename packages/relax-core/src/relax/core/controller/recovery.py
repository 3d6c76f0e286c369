"""Step commits, emergency checkpoints on failure, and trainer restarts.

A step is *committed* when the trainer's update for it has returned: the run's step and its weight
version advance together, and the checkpointed data position follows the step
(``PromptSource.position_after``). An
emergency checkpoint saves exactly the committed state -- if the failure struck while a train step
was in flight, it first waits (bounded) for that step and commits it, or saves nothing if it
failed -- so ``checkpoint.resume=auto`` continues without skipping or repeating a prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax.core.controller import faults, signals

if TYPE_CHECKING:
    from relax.core.controller.step import StepContext

log = logging.getLogger("relax")


# ---------------------------------------------------------------------------- step commits


def commit_step(state: StepContext, step: int, trained: bool) -> None:
    """``step`` is done: the run's step and weight version advance together, and the fleet is told
    the trainer's new version (an engine started from now on gets it)."""
    state.step = step
    state.version += 1 if trained else 0
    state.fleet.trained(state.version)
    state.train_inflight = None
    state.prompts.forget_before(step)


def train(state: StepContext, batch: dict, step: int) -> dict[str, float]:
    """One bounded ``train_step`` for ``step``, committed as soon as it returns. Holds the fleet's
    ``weights_lock`` so no replacement engine is synced while weights and version disagree."""
    with state.fleet.weights_lock:
        ref = state.roles.trainer.train_step.remote(batch)
        state.train_inflight = (ref, step)
        metrics = faults.wait(ref, state.cfg.trainer.timeout_s, "trainer", "train_step")
        commit_step(state, step, trained=True)
    return metrics


# ---------------------------------------------------------------------------- on failure


def trainer_lost(state: StepContext) -> bool:
    """The trainer actor (or any rank of its worker group) is dead."""
    ranks = [state.roles.trainer, *getattr(state.roles, "trainer_peers", [])]
    return not all(faults.alive(h, state.cfg.rollout.control_timeout_s) for h in ranks)


def emergency_checkpoint(state: StepContext, error: BaseException) -> Path | None:
    """Save the committed state if the trainer is alive; returns the checkpoint (None: nothing saved,
    with the reason logged). A second Ctrl-C skips it."""
    guard = signals.current()
    try:
        with signals.phase("checkpoint"):
            if guard is not None and guard.skip_checkpoint:
                log.warning("relax: emergency checkpoint skipped (interrupted again)")
                return None
            return _emergency_checkpoint(state, error)
    except KeyboardInterrupt:
        log.warning("relax: emergency checkpoint skipped (interrupted again)")
        return None
    except Exception as exc:  # never mask the original failure
        if _trainer_died(exc):  # died after the check above (Ray had not yet marked it dead)
            error.relax_trainer_lost = True  # type: ignore[attr-defined]
        log.error("relax: emergency checkpoint failed: %s", faults.describe(exc))
        return None


def _trainer_died(exc: BaseException) -> bool:
    return isinstance(exc, faults.RoleDied) and exc.role == "trainer"


def blame_trainer(error: BaseException) -> BaseException:
    """The error to report: the trainer's death when the run lost its trainer, whatever failed first
    (an engine stuck at the same moment would otherwise be blamed); ``error`` itself otherwise."""
    if (
        not getattr(error, "relax_trainer_lost", False)
        or isinstance(error, faults.RoleError)
        and error.role == "trainer"
    ):
        return error
    if isinstance(error, KeyboardInterrupt):
        return error
    blamed = faults.RoleDied(f"trainer died (the run also saw: {reason(error)})", "trainer")
    blamed.relax_trainer_lost = True  # type: ignore[attr-defined]
    return blamed


def _emergency_checkpoint(state: StepContext, error: BaseException) -> Path | None:
    cfg = state.cfg
    if _trainer_died(error) or trainer_lost(
        state
    ):  # its death seen first (a node lost: Ray marks it dead later)
        log.error("relax: no emergency checkpoint: the trainer is gone")
        error.relax_trainer_lost = True  # type: ignore[attr-defined]
        return None
    if state.train_inflight is not None:  # the failure struck mid-update: settle that step first
        ref, step = state.train_inflight
        try:
            faults.wait(ref, cfg.trainer.timeout_s, "trainer", "train_step")
        except Exception as exc:
            if _trainer_died(exc):
                error.relax_trainer_lost = True  # type: ignore[attr-defined]
            log.error(
                "relax: no emergency checkpoint: the trainer failed mid-step (%s)", faults.describe(exc)
            )
            return None
        commit_step(state, step, trained=True)
    if state.pipeline is not None:
        state.pipeline.close()  # the producer stops drawing prompts; trained positions stay recorded
    latest = state.checkpoints.latest()
    if state.step == 0 or (latest is not None and latest.name == f"step_{state.step:06d}"):
        return latest  # nothing trained since the last checkpoint
    started = time.perf_counter()
    path = state.save_checkpoint()
    log.warning(
        "relax: emergency checkpoint at step %d: %s (%.1fs)", state.step, path, time.perf_counter() - started
    )
    return path


# ---------------------------------------------------------------------------- restarts


def restart_point(cfg: Any, checkpoints_root: Path, since: float) -> str:
    """Where a restarted attempt resumes: the newest checkpoint this run wrote (``since`` = its start
    time), else where the run itself started from (``checkpoint.resume`` as configured)."""
    from relax.core.checkpoint import CheckpointManager, problems

    written = [p for _, p in CheckpointManager(checkpoints_root).list() if p.stat().st_mtime >= since]
    valid = [p for p in written if not problems(p)]
    return str(valid[-1]) if valid else cfg.checkpoint.resume


def with_trainer_restarts(
    cfg: Any, attempt: Callable[[Any, faults.FaultCounters], dict[str, Any]]
) -> dict[str, Any]:
    """Run ``attempt(cfg, counters)``; when it fails because the trainer actor died, run it again
    from the latest checkpoint, up to ``trainer.max_restarts`` times."""
    counters = faults.FaultCounters()
    since = time.time() - 1.0  # mtime granularity
    root = Path(cfg.run_dir) / "checkpoints"
    restarts = 0
    while True:
        try:
            return attempt(cfg, counters)
        except Exception as exc:
            if not getattr(exc, "relax_trainer_lost", False) or restarts >= cfg.trainer.max_restarts:
                raise
            restarts += 1
            counters.add("trainer_restarts")
            resume = restart_point(cfg, root, since)
            log.error(
                "relax: the trainer died (%s); restarting the run from %s (restart %d of %d)",
                faults.describe(exc),
                resume,
                restarts,
                cfg.trainer.max_restarts,
            )
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))


def annotate(error: BaseException, state: Any, checkpoint: Path | None) -> None:
    """Attach what the CLI reports: the step reached and the checkpoint to resume from."""
    error.relax_step = getattr(state, "step", 0)  # type: ignore[attr-defined]
    latest = checkpoint or (state.checkpoints.latest_valid()[0] if state is not None else None)
    error.relax_checkpoint = str(latest) if latest else None  # type: ignore[attr-defined]


def resume_point(cfg: Any, checkpoint: str | None) -> tuple[str | None, str]:
    """What the CLI's "start again with" command resumes from: (the checkpoint, or None, and the
    ``checkpoint.resume=...`` override). Always an override, so the command never restarts at step 0
    over an existing run directory: ``auto`` for a checkpoint of this run (or none yet), else the
    checkpoint's path, or the configured path the run never got past."""
    from relax.core.checkpoint import CheckpointManager

    root = Path(cfg.run_dir) / "checkpoints"
    if checkpoint is None:
        try:
            found = CheckpointManager(root).latest_valid()[0]
        except OSError:
            found = None
        checkpoint = str(found) if found is not None else None
    if checkpoint is not None:
        in_run = Path(checkpoint).parent == root
        return checkpoint, "checkpoint.resume=auto" if in_run else f"checkpoint.resume={checkpoint}"
    configured = cfg.checkpoint.resume
    return None, f"checkpoint.resume={configured if configured not in ('auto', 'never') else 'auto'}"


def write_error_log(run_dir: str | Path, error: BaseException) -> Path | None:
    """Append ``error``'s traceback to ``<run_dir>/error.log`` under a dated header; None when the file
    cannot be written. Appended, never overwritten: a resume that fails (say, before a node with the
    trainer's label exists) keeps the traceback of the failure it was resuming from."""
    import traceback

    path = Path(run_dir) / "error.log"
    header = f"=== relax run failed at {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason(error)}\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(header + "".join(traceback.format_exception(error)) + "\n")
    except OSError:
        return None
    return path


def reason(error: BaseException) -> str:
    """The one-line reason the CLI prints."""
    if isinstance(error, signals.Interrupted):
        return f"interrupted by {error.signame}"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, faults.RoleError | faults.NoEnginesLeft):
        return _first_line(error)  # already names the role, its index and the operation
    cause = _root_cause(error)  # a role actor's own exception, not Ray's "ray::Role.op() (pid=...)" header
    first = _first_line(cause)
    where = next((n for n in getattr(error, "__notes__", []) if n.startswith("(raised by ")), "")
    text = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return f"{text} {where}".rstrip()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _root_cause(error: BaseException) -> BaseException:
    from relax.core import lazy_ray

    return faults.root_cause(error) if lazy_ray.imported() else error  # no Ray imported: nothing wrapped it
