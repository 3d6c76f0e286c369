"""Multi-turn rollouts end to end in every mode (``environment.name``), through real Ray where the mode uses it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=16",
    "data.task_size=200",
    "environment.name=repeat",
    "environment.params.turns=2",
    "environment.max_total_tokens=40",
    "reward.name=environment",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "total_steps=2",
]


@pytest.fixture
def repeat_env(monkeypatch):
    monkeypatch.setenv("RELAX_PLUGINS", "relax.core.testing.episodes")
    get_plugin_manager(refresh=True)
    yield
    monkeypatch.delenv("RELAX_PLUGINS")
    get_plugin_manager(refresh=True)


@pytest.mark.parametrize(
    ("mode", "extra"), [("colocate", []), ("async", ["max_staleness=1"]), ("hybrid", ["max_staleness=1"])]
)
def test_two_turn_episodes_train_in_every_mode(ray_session, repeat_env, tmp_path, mode, extra):
    run_dir = tmp_path / mode
    run(load_config(None, [*SMALL, f"run_dir={run_dir}", f"mode={mode}", *extra]))
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["episode/turns_mean"] == 2.0  # every episode ran both turns
        assert row["episode/observation_tokens_mean"] > 0  # "again" appended between them
        assert row["episode/errors_mean"] == 0 and row["episode/timeouts_mean"] == 0
        assert 0.0 <= row["reward/mean"] <= 1.0 and math.isfinite(row["train/loss"])
        assert row["response/length_mean"] > 6  # two turns plus an observation, not one completion
