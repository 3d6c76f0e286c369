"""The quick-start learns: seeds 0-2 each reach a 5-step-mean reward of 0.8 (``bench/vs_trl.py``'s
target) well within the bundled run, with every role in the driver as ``relax run`` places them."""

from __future__ import annotations

import json

import pytest

from relax.core.config import load_config
from relax.core.controller.hosting import in_driver
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
STEPS, TARGET, WINDOW = (
    100,
    0.8,
    5,
)  # seeds 0-12 reach it in 36-58 steps here (2026-12-03); a run is deterministic
# on one machine, but another CPU's kernels round differently and take it elsewhere: on CI's, seed 1 had a best
# 5-step mean of 0.725 in 55 steps once, 0.781 in 70 another time (it reaches 0.8 by step 36 here)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_quickstart_reaches_reward_0_8(tmp_path, seed):
    cfg = load_config(
        None,
        [
            f"seed={seed}",
            f"total_steps={STEPS}",
            f"run_dir={tmp_path}",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
        ],
    )
    assert in_driver(cfg)
    run(cfg)
    rewards = [
        json.loads(line)["reward/mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    means = [sum(rewards[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(rewards) + 1)]
    assert len(rewards) == STEPS and means[0] < 0.5, means[:3]  # it starts far from the target ...
    assert max(means) >= TARGET, (  # ... and gets there
        f"seed {seed}: best {WINDOW}-step mean {max(means):.3f} in {STEPS} steps; every 10th: {[round(m, 2) for m in means[::10]]}"
    )
