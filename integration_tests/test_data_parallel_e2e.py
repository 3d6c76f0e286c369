"""The quick-start with a data-parallel trainer (two rank actors over gloo) end to end, and no
placement group left behind by the run."""

from __future__ import annotations

import json
import math

import pytest
from ray.util import placement_group_table

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow


def test_quickstart_with_world_size_2_trains_and_releases_its_placement(ray_session, tmp_path):
    run_dir = tmp_path / "dp"
    before = set(placement_group_table())
    cfg = load_config(
        None,
        [
            "total_steps=3",
            f"run_dir={run_dir}",
            "trainer.backend_params={world_size: 2}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "trainer.micro_batch_size=8",
            "data.task_size=200",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    summary = run(cfg)
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(
            math.isfinite(r[k]) for k in ("train/loss", "train/grad_norm", "train/entropy", "reward/mean")
        )
        assert r["train/grad_norm"] > 0 and r["train/entropy"] > 0
    assert (run_dir / "checkpoints").is_dir()  # written by rank 0
    new = {k: v for k, v in placement_group_table().items() if k not in before}
    assert new, "the run reserved no placement group"
    assert {v["state"] for v in new.values()} == {"REMOVED"}, new
    assert [len(v["bundles"]) for v in new.values()] == [2]  # colocate: one group, a bundle per trainer rank
