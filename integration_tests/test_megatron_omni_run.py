"""The vision quick-start on the megatron trainer at TP=2 through ``relax run``'s code path: two rank actors
train the tiny Qwen2.5-VL (the HF towers as the media front, megatron-core's decoder with M-RoPE) and the
policy learns to read its media, as the torch run does (integration_tests/test_omni_examples.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_omni_vl.yaml"
# The quick-start's bar (a 5-step mean of 0.6, beyond a media-blind policy: chance is 0.42) from a first step
# near chance, and the torch test's rise (best 5-step mean minus the first step's reward). The per-step curve
# differs across CPUs: measured 0.45 0.46 0.29 0.52 0.58 0.62 0.77 0.86 0.95 1.00 (5-step means 0.46 -> 0.84).
STEPS, WINDOW, TARGET, START, RISE = 10, 5, 0.6, 0.5, 0.3


def test_the_vl_quickstart_learns_on_megatron_tp2(ray_session, tmp_path):
    """10 steps of the quick-start (its own rows, model and settings; the trainer swapped for megatron's at TP=2)."""
    cfg = load_config(
        str(EXAMPLE),
        [
            "trainer.backend=megatron",
            "trainer.backend_params.tensor_parallel=2",
            f"total_steps={STEPS}",
            f"run_dir={tmp_path}",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
        ],
        check_paths=True,
    )
    assert cfg.trainer.backend == "megatron" and cfg.trainer.backend_params.tensor_parallel == 2
    summary = run(cfg)
    assert summary["steps"] == STEPS
    rewards = [
        json.loads(line)["reward/mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    means = [sum(rewards[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(rewards) + 1)]
    assert rewards[0] < START, f"first step's reward {rewards[0]:.3f}: a head start, not chance"
    assert max(means) >= TARGET, f"best {WINDOW}-step mean {max(means):.3f} in {STEPS} steps: {rewards}"
    assert max(means) - rewards[0] >= RISE, (rewards[0], max(means))
