"""``run(cfg)``: set up a run (Ray, roles, data, logging, resume) and drive the configured mode."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from tqdm import tqdm

from relax.core.checkpoint import CheckpointError, CheckpointManager, read_controller_state, resolve_resume
from relax.core.cluster import driver_paths
from relax.core.config import RelaxConfig, with_inputs
from relax.core.controller import closing, faults, places, recovery, runtime, signals, startup, teardown
from relax.core.controller.episodes import build_turns
from relax.core.controller.faults import FaultCounters
from relax.core.controller.fleet import EngineFleet
from relax.core.controller.handle import RunControl, RunHandle
from relax.core.controller.hosting import in_driver
from relax.core.controller.prompts import PromptSource
from relax.core.plugins import get_plugin_manager

if TYPE_CHECKING:
    from relax.core.controller.pipeline import Pipeline
    from relax.core.protocols import WeightSync

log = logging.getLogger("relax")

CONSOLE_KEYS = (
    "reward/mean",
    "reward/accuracy",
    "response/length_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "kl/policy_ref",
    "perf/tokens_per_s",
    "time/step_s",
)
PLOT_KEYS = ("reward/mean", "response/length_mean")


class RunState:
    """Everything a mode step needs (``controller.step.StepContext``), plus logging and checkpointing
    around each step. Every attribute is declared here; none is added later."""

    cfg: RelaxConfig
    run_dir: Path
    started_ray: bool
    model_path: str
    tokenizer: Any
    pad_id: int
    stop_token_ids: list[int]
    dataset: Any  # relax.core.dataset.PromptDataset
    turns: Any  # relax.core.agentic.Turns (multi-turn rollouts), or None
    first_metrics: dict[str, float]  # logged with the first step, then emptied (data counts)
    roles: runtime.Roles
    weight_sync: WeightSync  # the run's transport; the fleet drives it
    checkpoints: CheckpointManager
    fleet: EngineFleet
    train_inflight: tuple[Any, int] | None  # (ref, step) while a train step runs: see controller.recovery
    step: int
    version: int  # the trainer's weight version: the one source, told to the fleet as it changes
    last_metrics: dict[str, float]
    prompts: PromptSource
    pipeline: Pipeline | None  # async/hybrid modes create it on their first step
    fused_old_logprobs: bool | None  # colocate asks the trainer once (controller.colocate)
    metrics: Any  # relax.core.metrics.MetricsLogger
    evaluator: Any  # relax.core.controller.evaluator.Evaluator: the eval sets and their schedule
    sample_log: Any  # relax.core.evaluation.sample_log.SampleLog (logging.log_samples), or None
    failures: Any  # relax.core.failures.FailureLog: failed episodes, tools, rewards to the console and failures.jsonl

    def __init__(
        self,
        cfg: RelaxConfig,
        counters: FaultCounters | None = None,
        setup: startup.BackgroundSetup | None = None,
        clock: startup.StartupClock | None = None,
        early: startup.EarlyStart | None = None,
    ) -> None:
        from relax.core.metrics import MetricsLogger

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.started_ray = runtime.init_ray(cfg)
        # model path, tokenizer, stop ids (EOS + chat-template end ids, never <unk>), dataset: prepared
        # while Ray started when ``setup`` is given (see controller.startup)
        local = setup.take(cfg) if setup is not None else startup.prepare_local(cfg)
        self.model_path, self.tokenizer, self.pad_id = local.model_path, local.tokenizer, local.pad_id
        self.stop_token_ids, self.dataset = local.stop_token_ids, local.dataset
        self.first_metrics = {f"data/{k}": float(v) for k, v in self.dataset.stats.items()}
        self.turns = build_turns(
            cfg, self.tokenizer, self.stop_token_ids, self.model_path, self.dataset.processor
        )
        if clock is not None:
            clock.add_overlapped("model, tokenizer, data", local.seconds)
            clock.mark("tokenizer, data" if in_driver(cfg) else "setup beyond ray")
        early_roles = early.take_roles() if early is not None else None  # started while the driver imported
        self.roles = early_roles or runtime.start_roles(cfg, self.model_path)
        if clock is not None:
            if early_roles is not None:
                clock.add_overlapped("roles", early.seconds.get("roles", 0.0))
            clock.mark("waiting for roles" if early_roles is not None else "roles")
        try:
            self.weight_sync = runtime.build_weight_sync(cfg, self.model_path, self.roles.hosted)
        except BaseException:
            closing.run_all([("role actors", self.roles.release)])
            raise
        try:
            self.checkpoints = CheckpointManager(
                self.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last
            )
            # engines by stable index; the reward's judge handle follows the live set. A trainer-hosted
            # engine is never replaced: it fails with its trainer (controller.recovery restarts both)
            fleet_cfg = (
                replace(cfg, rollout=replace(cfg.rollout, max_restarts=0)) if self.roles.hosted else cfg
            )
            self.fleet = EngineFleet(
                fleet_cfg,
                self.roles.engines,
                runtime.engine_starter(cfg, self.model_path, self.roles),
                self.weight_sync,
                self.roles.trainer,
                counters,
                on_change=lambda engines: self.roles.reward.set_engines.remote(engines),
                places=None
                if self.roles.hosted or in_driver(cfg)
                else places.for_run(cfg, self.roles.placement),
            )
            self.train_inflight = None
            self.step = 0
            self.last_metrics = {}
            self.version = 0
            self.prompts = PromptSource(self.dataset, cfg)
            self.pipeline = None
            self.fused_old_logprobs = None
            resume_from = resolve_resume(cfg.checkpoint.resume, self.checkpoints.root)
            if resume_from is not None:
                self._resume(resume_from)
            lc = cfg.logging
            backends = [
                name
                for name, on in [
                    ("console", lc.console),
                    ("tensorboard", lc.tensorboard),
                    ("wandb", lc.wandb),
                    ("clearml", lc.clearml),
                ]
                if on
            ]
            self.metrics = MetricsLogger(
                self.run_dir,
                backends=backends,
                console_keys=CONSOLE_KEYS + tuple(f"eval/{name}/accuracy" for name in cfg.eval.sets),
                project=lc.wandb_project,
                run_name=cfg.name,
                config=cfg.to_dict(),
                resume_step=self.step
                if resume_from is not None
                else -1,  # fresh: no row kept, step 0's eval neither
            )
            from relax.core.controller.evaluator import Evaluator
            from relax.core.evaluation.sample_log import SampleLog

            resumed = self.step if resume_from is not None else None
            self.evaluator = Evaluator(
                cfg,
                self.tokenizer,
                self.stop_token_ids,
                self.model_path,
                self.roles.reward,
                self.turns,
                self.roles.engines,
                resume_step=resumed,
            )
            self.sample_log = (
                SampleLog(self.run_dir, lc.log_samples, self.metrics, resumed, self.tokenizer)
                if lc.log_samples
                else None
            )
            from relax.core.failures import FailureLog

            self.failures = FailureLog(
                self.run_dir,
                lc.failure_warnings,
                lc.fail_if_failure_rate_above,
                lc.failure_window_steps,
                resumed,
            )
        except BaseException:  # e.g. a resume that fails: nothing started may outlive the attempt
            self._release_roles()
            raise

    # ------------------------------------------------------------------ checkpointing

    def _resume(self, path: Path) -> None:
        state = read_controller_state(path)
        try:
            faults.wait(
                self.roles.trainer.load.remote(str(path / "trainer")),
                self.cfg.trainer.timeout_s,
                "trainer",
                "load",
            )
        except faults.RoleError:
            raise  # dead or silent: the trainer's fault, not the checkpoint's
        except Exception as exc:  # e.g. an older checkpoint (no manifest) with a damaged file
            raise CheckpointError(
                f"checkpoint {path}: the trainer could not load {path / 'trainer'} ({faults.describe(exc)})"
            ) from exc
        self.step, self.version = state["step"], state["version"]
        self.prompts.restore(self.step, (state["dataset"], state["next_group_id"]))
        random.setstate(_tuplify(state["py_random"]))
        np.random.set_state(tuple(state["np_random"]))
        self.fleet.sync(self.version)
        log.info("resumed from %s at step %d (weight version %d)", path, self.step, self.version)

    def save_checkpoint(self) -> Path:
        """Model, optimizer and RNG state plus the data position after the last trained step (the
        producer may have drawn further ahead: those prompts are drawn again after a resume)."""
        dataset_state, next_group_id = self.prompts.position_after(self.step)
        state = {
            "step": self.step,
            "version": self.version,
            "model_path": self.model_path,  # what relax convert writes the trainer's model back into
            "next_group_id": next_group_id,
            "dataset": dataset_state,
            "py_random": random.getstate(),
            "np_random": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        }
        return self.checkpoints.save(
            self.step,
            lambda tmp: faults.wait(
                self.roles.trainer.save.remote(str(tmp / "trainer")),
                self.cfg.trainer.timeout_s,
                "trainer",
                "save",
            ),
            state,
        )

    # ------------------------------------------------------------------ engine set (control API)

    def add_engine(self) -> int:
        """Start a rollout engine, synced to the current weight version before it serves; returns
        its (new, never reused) index. Call between steps (``RunControl.add_engine``)."""
        return self.fleet.add_engine()

    def remove_engine(self, index: int) -> None:
        """Stop and kill rollout engine ``index``; its in-flight requests go to the other engines."""
        self.fleet.remove_engine(index)

    def evaluate_before_train(self) -> None:
        """``eval.before_train``: the starting model's scores, logged as step 0 (a resumed run has them)."""
        if self.step == 0 and self.evaluator.due(0):
            metrics = {
                "step": 0.0,
                "policy_version": float(self.version),
                **self.evaluator.evaluate(self.fleet.router, 0, self.version),
            }
            self.metrics.log(0, metrics)
            self.last_metrics = dict(metrics)

    def end_step(self, metrics: dict[str, float]) -> None:
        if self.evaluator.due(self.step):  # after the step's weight sync: the engines hold the new weights
            metrics.update(self.evaluator.evaluate(self.fleet.router, self.step, self.version))
        metrics["step"] = float(self.step)
        metrics["policy_version"] = float(self.version)
        metrics.update(self.first_metrics)
        self.first_metrics = {}
        from relax.core.data_multimodal import draw_counts

        metrics.update(draw_counts(self.dataset))  # media prompts are skipped / filtered as they are drawn
        self.last_metrics = {
            **self.evaluator.latest,
            **metrics,
        }  # the REST status shows the latest eval between evals
        self.metrics.log(self.step, metrics)
        get_plugin_manager().hook.relax_on_step_end(step=self.step, metrics=dict(metrics))
        every = self.cfg.checkpoint.save_every
        if every and self.step % every == 0 and self.step < self.cfg.total_steps:
            self.save_checkpoint()

    def finish(self) -> dict[str, Any]:
        self.failures.finish()  # a run in which most samples failed is no success (relax.core.failures)
        if self.cfg.checkpoint.save_final:
            self.save_checkpoint()
        final_dir = None
        if self.cfg.checkpoint.save_hf_final:
            final_dir = self.run_dir / "final_hf"
            from relax.core.disk import disk_guard

            with disk_guard("final HF save", final_dir):  # a full disk names the path and the cause
                faults.wait(
                    self.roles.trainer.save_hf.remote(str(final_dir)),
                    self.cfg.trainer.timeout_s,
                    "trainer",
                    "save_hf",
                )
        self.metrics.close()
        if self.cfg.logging.plot:
            from relax.core.metrics_plot import plot_curves

            agentic = (
                ("episode/tool_calls_mean",) if self.cfg.environment.name else ()
            )  # multi-turn: tool use too
            evals = tuple(
                f"eval/{name}/accuracy" for name in self.cfg.eval.sets
            )  # held-out scores beside the reward
            plot_curves(
                self.run_dir / "metrics.jsonl", self.run_dir / "curves.png", keys=PLOT_KEYS + evals + agentic
            )
        return {
            "run_dir": str(self.run_dir),
            "final_hf": str(final_dir) if final_dir else None,
            "steps": self.step,
            "failures": self.failures.summary(),
        }

    def shutdown(self) -> None:
        """End of the run, completed or failed: stop the fleet and the pipeline, have every role close
        its plugin objects and weight-sync sides, kill the actors, close the driver's transport. Each
        part runs even when one before it failed (``controller.closing``)."""
        closing.run_all(
            [
                (
                    "the engine fleet",
                    self.fleet.close,
                ),  # no more replacements; streams waiting for an engine stop
                ("the async pipeline", self.pipeline.close if self.pipeline is not None else None),
                ("the environment", self.turns.close if self.turns is not None else None),
                ("the eval sets", self.evaluator.close if hasattr(self, "evaluator") else None),
            ]
        )
        self._release_roles()
        if self.started_ray:
            ray.shutdown()

    def _release_roles(self) -> None:
        r = self.roles
        closing.run_all(
            [
                (
                    "plugin objects",
                    lambda: closing.close_roles(
                        [r.trainer, *r.trainer_peers, r.reference, r.teacher, r.reward, *r.engines],
                        self.cfg.rollout.control_timeout_s,
                    ),
                ),
                ("role actors", r.release),  # kills every actor and removes the run's placement groups
                (
                    "weight_sync transport",
                    self.weight_sync.close,
                ),  # after the kill: what the trainer's sender left
            ]
        )


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


def run(
    cfg: RelaxConfig, early: startup.EarlyStart | None = None, launched: float | None = None
) -> dict[str, Any]:
    """Run training to ``cfg.total_steps``; returns a summary (run dir, final model dir, last metrics).

    Faults: SIGINT/SIGTERM interrupt the run (see ``controller.signals``); on any failure an
    emergency checkpoint of the last committed step is saved if the trainer is alive, and the
    exception carries ``relax_step`` / ``relax_checkpoint``; a dead trainer restarts the run from
    its latest checkpoint up to ``trainer.max_restarts`` times; an embedded Ray is torn down
    completely (``controller.teardown``) however the run ends.

    ``early``: Ray and the roles already starting in a thread (``relax run``, see
    ``startup.EarlyStart``); the run takes them over. ``launched``: when the process started (``relax run``),
    for the first step's start-up line; without it, the line counts from this call."""
    cfg = driver_paths(with_inputs(cfg))  # inputs.name: a plugin's model and data, built on first use; paths
    # absolute: the roles run elsewhere (other nodes, other current directories)
    clock = startup.StartupClock(launched)
    if launched is not None:
        clock.mark("python + imports")
    with signals.guarded():
        setup = startup.BackgroundSetup(cfg)  # no Ray needed: runs while Ray starts
        try:
            started_ray = early.ray() if early is not None else runtime.init_ray(cfg)
            if early is not None:
                clock.add_overlapped("ray", early.seconds.get("ray", 0.0))
            if not in_driver(cfg):  # every role in the driver: no Ray phase
                clock.mark("waiting for ray" if early is not None else "ray")
            if (guard := signals.current()) is not None:
                guard.install()  # ray.init installs its own SIGTERM handler
            try:
                attempt = partial(_run_attempt, setup=setup, clock=clock, early=early)
                return recovery.with_trainer_restarts(cfg, attempt)
            finally:
                if started_ray:
                    with signals.phase("cleanup"):
                        teardown.shutdown_ray()
        finally:
            if early is not None:
                early.release()


def _run_attempt(
    cfg: RelaxConfig,
    counters: FaultCounters,
    setup: startup.BackgroundSetup | None = None,
    clock: startup.StartupClock | None = None,
    early: startup.EarlyStart | None = None,
) -> dict[str, Any]:
    from relax.core.controller.colocate import colocate_step
    from relax.core.controller.modes import MODE_LOOPS

    step_fns = {"colocate": colocate_step, **MODE_LOOPS}
    if clock is not None and clock.reported:
        clock = None  # a restarted attempt: the start-up line was printed already
    state = RunState(cfg, counters, setup, clock, early)
    notify_url = cfg.logging.webhook_url
    handle = RunHandle(state, RunControl())
    hook = get_plugin_manager().hook
    status = "failed"
    try:
        hook.relax_on_run_start(run=handle)
        if clock is not None:
            clock.mark("ready")
            clock.report()  # where the seconds before the first step went
        last: dict[str, float] = {}
        bar = tqdm(
            total=cfg.total_steps,
            initial=state.step,
            desc="train steps",
            disable=not cfg.logging.progress,
            unit="step",
        )
        started = time.perf_counter()
        state.evaluate_before_train()
        while state.step < cfg.total_steps:
            handle.control.apply(state)  # plugins' pause / checkpoint / engine requests, between steps
            last = step_fns[cfg.mode](state)
            bar.update(1)
            bar.set_postfix(
                reward=f"{last.get('reward/mean', 0):.3f}", len=f"{last.get('response/length_mean', 0):.1f}"
            )
        bar.close()
        summary = state.finish()
        summary.update(last_metrics=last, seconds=time.perf_counter() - started)
        if notify_url:
            from relax.core.metrics import notify

            notify(notify_url, "completed", {"name": cfg.name, **summary})
        status = "completed"
        return summary
    except KeyboardInterrupt as exc:
        status = "interrupted"
        recovery.annotate(exc, state, recovery.emergency_checkpoint(state, exc))
        raise
    except BaseException as exc:
        checkpoint = recovery.emergency_checkpoint(state, exc)
        error = recovery.blame_trainer(exc)  # a lost trainer is the cause, whatever failed first
        recovery.annotate(error, state, checkpoint)
        if notify_url:
            from relax.core.metrics import notify

            notify(notify_url, "failed", {"name": cfg.name, "step": state.step, "error": repr(error)})
        if error is not exc:
            raise error from exc
        raise
    finally:
        handle.control.cancel_pending(status)
        try:
            hook.relax_on_run_end(run=handle, status=status)
        finally:
            state.shutdown()
