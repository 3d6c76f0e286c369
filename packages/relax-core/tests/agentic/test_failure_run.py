"""Issue 42 end to end: a run (every role in the driver, a real tiny model) with a faulty environment plugin.

A run where every episode fails stops with the reason instead of exiting 0; a run where some fail completes
and its end summary, ``failures.jsonl`` and ``relax inspect`` show which and why, and the trajectories'
trained and masked tokens."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from relax.core import cli, plugins
from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.failures import FailureRateError
from relax.core.testing.models import tiny_model_dir

sys.path.insert(0, str(Path(__file__).parent))
import lookup_env  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "rollout.host=driver",
    "trainer.micro_batch_size=8",
    "data.task_size=20",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "environment.name=lookup",
    "environment.tool_parser=lookup_calls",
    "environment.max_turns=2",
    "environment.max_total_tokens=64",
    "reward.name=environment",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(
        tmp_path_factory.getbasetemp()
    )  # the session's (shared with the conformance suites)


@pytest.fixture
def with_plugin(monkeypatch):
    """The plugin loaded as RELAX_PLUGINS would load it (the process-wide manager the run and the CLI use)."""
    monkeypatch.setattr(
        plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"lookup_env": lookup_env})
    )


def test_a_run_where_every_episode_fails_stops_naming_the_reason(with_plugin, model_dir, tmp_path, caplog):
    cfg = load_config(
        None,
        [
            *SMALL,
            f"model.path={model_dir}",
            "total_steps=3",
            f"run_dir={tmp_path}",
            "environment.params.fault=raise",
            "logging.failure_window_steps=1",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="relax"), pytest.raises(FailureRateError) as err:
        run(cfg)
    assert "8 of 8 samples failed over the last 1 step(s)" in str(err.value)
    assert "top reason: 8x episode: turn 0: episode raised RuntimeError: lookup table is gone" in str(
        err.value
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "relax: step 1: episode failed (group 0 index 0): turn 0: episode raised RuntimeError: lookup table is gone"
        in warnings
    )
    rows = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["step"] for r in rows} == {1}  # stopped before training on the failed step
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()


def test_some_failures_are_summarised_and_trajectories_can_be_inspected(
    with_plugin, model_dir, tmp_path, capsys
):
    cfg = load_config(
        None,
        [
            *SMALL,
            f"model.path={model_dir}",
            "total_steps=1",
            f"run_dir={tmp_path}",
            "environment.params.fault=int_content",
            "environment.params.fault_on_index=0",
            "logging.log_samples=8",
            "checkpoint.save_final=false",
        ],
    )
    summary = run(cfg)
    assert summary["failures"]["counts"] == {"episode": 2} and summary["failures"]["failed_samples"] == 2
    assert summary["failures"]["top_reasons"] == [
        "2x episode: turn 0: Episode.step returned observations[0]['content']=42 (int); expected a string "
        "(or a list of parts such as {'type': 'image', 'image': ...} for media)"
    ]
    assert not (tmp_path / "checkpoints" / "step_1").exists()  # checkpoint.save_final: false
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path)]) == 0  # the last step logged
    out = capsys.readouterr().out
    assert out.count("=== step 1 group") == 4 + 4  # two groups of four
    assert "FAILED (episode): turn 0: Episode.step returned observations[0]['content']=42 (int)" in out
    assert "    observation: an RL engine" in out  # the healthy episodes' tool result
    assert "[trained " in out and "[masked " in out and "an RL engine" in out.split("[masked ", 1)[1]
    assert "=== 2 failure(s) at step 1" in out  # index 0 of both groups
    row = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[-1])
    traj = row["trajectory"]
    assert len(traj["response_ids"]) == len(traj["loss_mask"]) == traj["spans"][-1]["end"]
    assert cli.main(["inspect", str(tmp_path), "--step", "9"]) == 2
    assert "logged steps: 1..1" in capsys.readouterr().err
