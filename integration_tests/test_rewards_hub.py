"""The reward hub inside a real run: ``examples/quickstart_math.yaml`` through ``relax run`` in async
mode (own process, real Ray, the tiny model), with extra routes whose components raise, call
``os._exit`` and hang. The run must complete, and the step's metrics must carry the fallback
scores' counts (``reward/failures``, ``reward/timeouts``) and the per-route / per-component means."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ROUTES = (
    "{bad: [{name: misbehave, params: {mode: raise, trigger: ''}}, "
    "{name: misbehave, params: {mode: exit, trigger: ''}}], "
    "hang: {name: misbehave, params: {mode: hang, trigger: ''}, timeout_s: 2}}"
)


def test_math_example_with_raising_exiting_and_hanging_routes_in_async_mode(tmp_path):
    rows = [
        json.loads(line) for line in (ROOT / "examples/data/quickstart_math.jsonl").read_text().splitlines()
    ]
    add = next(r for r in rows if r["data_source"] == "add")
    div = next(r for r in rows if r["data_source"] == "div")
    data = tmp_path / "mixed.jsonl"
    mixed = [add, div, {**add, "data_source": "bad"}, {**add, "data_source": "hang"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    run_dir = tmp_path / "run"
    args = [
        "mode=async",
        "max_staleness=1",
        "total_steps=1",
        f"run_dir={run_dir}",
        f"data.path={data}",
        "data.shuffle=false",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=2",
        "trainer.micro_batch_size=8",
        "trainer.num_minibatches=1",
        f"reward.params.routes={ROUTES}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "logging.console=false",
        "checkpoint.save_hf_final=false",
        "checkpoint.save_every=0",
    ]
    env = {**os.environ, "RELAX_PLUGINS": "relax.rewards.testing", "RAY_ADDRESS": ""}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "relax.core.cli", "run", "examples/quickstart_math.yaml", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - started < 400
    [step] = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"reward/' in line
    ]
    assert step["reward/failures"] == 4.0  # both "bad" samples (raise + os._exit) and both hung ones
    assert step["reward/timeouts"] == 2.0
    for key in (
        "reward/route/add_mean",
        "reward/route/div_mean",
        "reward/route/bad_mean",
        "reward/math/acc_mean",
        "reward/misbehave#0/failed_mean",
        "reward/misbehave#1/failed_mean",
    ):
        assert key in step, f"{key} missing from {sorted(k for k in step if k.startswith('reward/'))}"
    assert step["reward/route/bad_mean"] == 0.0 and step["reward/misbehave/failed_mean"] == 1.0  # fallback 0
    assert "reward hub: 'misbehave' (route 'hang') on sample group" in proc.stderr + proc.stdout
