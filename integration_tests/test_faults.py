"""Faults in real runs: engines and the trainer killed (SIGKILL) or stopped (SIGSTOP) by pid.

An observer plugin registered in the driver gets the run handle (``relax_on_run_start``) and
records every trained group (``relax_filter_group``), so the tests see each sample id end to end:
every one of the run's prompts is trained, each response exactly once and complete, and with
tokens from the weight version the step must use -- also those served by a replacement engine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray

from relax.core.config import load_config
from relax.core.controller.faults import NoEnginesLeft, RoleDied
from relax.core.controller.run import run
from relax.core.hookspecs import hookimpl
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

PROMPTS, GROUP, TOKENS = 4, 4, 16
SMALL = [
    f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.n_samples_per_prompt={GROUP}",
    f"rollout.max_new_tokens={TOKENS}",
    "rollout.ignore_eos=true",  # every complete response has exactly TOKENS tokens
    "trainer.micro_batch_size=16",
    "data.task_size=200",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "rollout.restart_backoff_s=0.2",
    "rollout.host=separate",  # engine faults need an engine process of its own (a hosted one is the trainer)
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Observer:
    """Driver-side plugin: the run handle, every trained sample, and a fault to inject."""

    def __init__(self, inject=None, on_step_end=None) -> None:
        self.inject = inject  # called in a thread with the run handle
        self.on_step_end = on_step_end  # called in the driver at the end of every step
        self.run = None
        self.trained: list[tuple[int, int, int, tuple[int, ...]]] = []  # (group, index, length, versions)
        self.stopped: list[int] = []  # pids to SIGCONT afterwards
        self.thread: threading.Thread | None = None

    @hookimpl
    def relax_on_run_start(self, run):
        self.run = run
        if self.inject is not None and self.thread is None:
            self.thread = threading.Thread(target=self.inject, args=(self, run), daemon=True)
            self.thread.start()

    @hookimpl
    def relax_on_step_end(self, step, metrics):
        if self.on_step_end is not None:
            self.on_step_end(self, self.run, step)

    @hookimpl
    def relax_filter_group(self, group):
        self.trained += [
            (s.group_id, s.index_in_group, len(s.response_ids), tuple(s.versions)) for s in group
        ]
        return True

    def check_every_sample_trained_once(self, steps: int, max_staleness: int = 0) -> None:
        ids = Counter((g, i) for g, i, _, _ in self.trained)
        assert ids == Counter({(g, i): 1 for g in range(steps * PROMPTS) for i in range(GROUP)}), (
            "lost or duplicated"
        )
        for group, _, length, versions in self.trained:
            step = group // PROMPTS + 1
            assert length == TOKENS, (group, length)  # a complete response, never a truncated retry
            assert step - 1 - max_staleness <= min(versions) and max(versions) <= step - 1, (group, versions)


@pytest.fixture
def observer():
    made = []

    def make(inject=None, on_step_end=None) -> Observer:
        obs = Observer(inject, on_step_end)
        get_plugin_manager().pm.register(obs, name=f"fault-observer-{id(obs)}")
        made.append(obs)
        return obs

    yield make
    for obs in made:
        for pid in obs.stopped:
            _signal(pid, signal.SIGCONT)
        if get_plugin_manager().pm.is_registered(obs):
            get_plugin_manager().pm.unregister(obs)


def _when_generating(run, at_step: int, timeout_s: float = 120.0) -> dict[int, object]:
    """Wait until the run is at ``at_step`` and an engine has requests in flight; returns the engines."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.step + 1 >= at_step:
            engines = run._state.fleet.live()
            busy = {
                i: h
                for i, h in engines.items()
                if ray.get(h.health.remote(), timeout=30).get("in_flight", 0) > 0
            }
            if busy:
                return busy
        time.sleep(0.02)
    raise AssertionError(f"never saw step {at_step} generating")


def _kill_one_engine_mid_step(obs: Observer, run) -> None:
    """SIGKILL an engine with requests in flight at step 2, then hold the next step until its
    replacement serves, so the rest of the run uses it (its tokens must carry the current version)."""
    busy = _when_generating(run, at_step=2)
    index, handle = min(busy.items())
    os.kill(_pid(handle), signal.SIGKILL)
    run.control.pause()
    deadline = time.monotonic() + 120
    while max(run._state.fleet.live()) < 2 and time.monotonic() < deadline:  # the replacement is engine[2]
        time.sleep(0.05)
    run.control.resume()


@pytest.mark.parametrize(("mode", "staleness"), [("colocate", 0), ("async", 1)])
def test_engine_killed_mid_step_is_replaced_and_nothing_is_lost(
    ray_session, tmp_path, observer, mode, staleness
):
    obs = observer(_kill_one_engine_mid_step)
    steps = 3
    cfg = load_config(
        None,
        [
            *SMALL,
            f"total_steps={steps}",
            f"run_dir={tmp_path}",
            f"mode={mode}",
            f"max_staleness={staleness}",
            "rollout.num_engines=2",
            "rollout.max_restarts=1",
        ],
    )
    summary = run(cfg)
    assert summary["steps"] == steps
    obs.check_every_sample_trained_once(steps, staleness)
    last = _metrics(tmp_path)[-1]
    assert last["fault/engine_evictions"] == 1 and last["fault/engine_restarts"] == 1
    assert last["fault/resubmitted_requests"] > 0  # the killed engine had requests in flight
    assert last["fault/engines_live"] == 2


def _stop(obs: Observer, handle) -> None:
    pid = _pid(handle)
    obs.stopped.append(pid)
    obs.stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)


def _stop_while_generating(obs: Observer, run) -> None:
    ((_, handle),) = _when_generating(run, at_step=2).items()
    _stop(obs, handle)


def _stop_when_idle_after_step_1(obs: Observer, run, step: int) -> None:
    """Async, staleness 1: once the engine has generated every step the gate allows (it is idle),
    stop it -- the trainer has its next rows, trains, and must then pause the stopped engine."""
    if step != 1:
        return
    (handle,) = run._state.fleet.live().values()
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 0.5:
        if ray.get(handle.health.remote(), timeout=30)["in_flight"]:
            idle_since = time.monotonic()
        time.sleep(0.02)
    _stop(obs, handle)


@pytest.mark.parametrize(
    ("mode", "operation", "bound"),
    [
        ("colocate", "finish generate", "rollout.timeout_s"),
        ("async", "answer pause", "rollout.control_timeout_s"),
    ],
)
def test_stopped_engine_fails_the_run_naming_it_within_the_bound(
    ray_session, tmp_path, observer, mode, operation, bound
):
    if mode == "colocate":
        obs = observer(inject=_stop_while_generating)
    else:
        obs = observer(on_step_end=_stop_when_idle_after_step_1)
    limit = 4.0
    cfg = load_config(
        None,
        [
            *SMALL,
            "total_steps=50",
            f"run_dir={tmp_path}",
            f"mode={mode}",
            "rollout.max_restarts=0",
            f"{bound}={limit}",
            f"max_staleness={int(mode == 'async')}",
        ],
    )
    with pytest.raises(NoEnginesLeft) as err:
        run(cfg)
    elapsed = time.monotonic() - obs.stopped_at
    assert f"rollout engine[0] did not {operation} within {limit:g}s" in str(err.value)
    assert "no rollout engine left (rollout.max_restarts=0" in str(err.value)
    # the bound runs from the call the engine stopped in, which may start just before obs.stopped_at
    assert limit - 1 <= elapsed < limit + 30, elapsed  # generous slack: a loaded 2-core machine
    assert err.value.relax_checkpoint is not None  # the trainer was alive: an emergency checkpoint


def _kill_the_only_engine(obs: Observer, run) -> None:
    ((_, handle),) = _when_generating(run, at_step=2).items()
    os.kill(_pid(handle), signal.SIGKILL)


def test_emergency_checkpoint_then_resume_auto_continues(ray_session, tmp_path, observer):
    obs = observer(_kill_the_only_engine)
    common = [
        *SMALL,
        "total_steps=3",
        f"run_dir={tmp_path}",
        "rollout.max_restarts=0",
        "checkpoint.keep_last=5",
    ]
    with pytest.raises(NoEnginesLeft, match=r"rollout engine\[0\] died during generate") as err:
        run(load_config(None, common))
    assert err.value.relax_step == 1
    assert err.value.relax_checkpoint == str(tmp_path / "checkpoints" / "step_000001")  # saved at the failure
    assert json.loads((tmp_path / "checkpoints" / "step_000001" / "controller.json").read_text())["step"] == 1
    get_plugin_manager().pm.unregister(obs)
    resumed = observer()
    summary = run(load_config(None, [*common, "checkpoint.resume=auto"]))
    assert summary["steps"] == 3
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]
    obs.trained = [t for t in obs.trained if t[0] < PROMPTS] + resumed.trained  # step 2's rollout was lost
    obs.check_every_sample_trained_once(3)


def _kill_the_trainer(obs: Observer, run) -> None:
    deadline = time.monotonic() + 120
    while run.step < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(_pid(run._state.roles.trainer), signal.SIGKILL)


def test_dead_trainer_restarts_from_the_latest_checkpoint(ray_session, tmp_path, observer):
    observer(_kill_the_trainer)
    cfg = load_config(
        None,
        [*SMALL, "total_steps=3", f"run_dir={tmp_path}", "checkpoint.save_every=1", "trainer.max_restarts=1"],
    )
    summary = run(cfg)
    assert summary["steps"] == 3
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["fault/trainer_restarts"] == 1
    assert rows[-1]["policy_version"] == 3


def _stop_the_engine_and_kill_the_trainer(obs: Observer, run) -> None:
    trainer = _pid(run._state.roles.trainer)
    ((_, handle),) = _when_generating(run, at_step=2).items()
    _stop(obs, handle)
    os.kill(trainer, signal.SIGKILL)


def test_stuck_engine_and_dead_trainer_report_the_trainer_and_start_no_replacement(
    ray_session, tmp_path, observer
):
    """The engine stops and the trainer dies at the same moment: the engine is evicted after its bound,
    but no replacement is started (it would be synced from a dead trainer), and the trainer's death
    is the reported cause, not the engine's."""
    obs = observer(inject=_stop_the_engine_and_kill_the_trainer)
    cfg = load_config(
        None,
        [
            *SMALL,
            "total_steps=50",
            f"run_dir={tmp_path}",
            "mode=colocate",
            "rollout.max_restarts=2",
            "rollout.timeout_s=4",
        ],
    )
    with pytest.raises(RoleDied) as err:
        run(cfg)
    assert err.value.role == "trainer" and str(err.value).startswith("trainer died"), str(err.value)
    assert "rollout engine[0] did not finish generate within 4s" in str(err.value)  # what the run also saw
    assert (
        err.value.relax_step == 1 and err.value.relax_checkpoint is None
    )  # no trainer: no emergency checkpoint
    fleet = obs.run._state.fleet
    assert fleet.counters.get("engine_evictions") == 1
    assert (
        fleet.replacements.started == 0 and fleet.counters.get("engine_start_failures") == 0
    )  # no replacement started
