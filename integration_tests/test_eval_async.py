"""Evaluation in async mode through real Ray: eval requests share the engines with the running producer,
the run finishes (no deadlock), and each result names the weight version its responses were written with."""

from __future__ import annotations

import json

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow


def test_async_run_evaluates_with_version_tagged_results(ray_session, tmp_path):
    cfg = load_config(
        None,
        [
            "mode=async",
            "max_staleness=1",
            "total_steps=4",
            f"run_dir={tmp_path}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "trainer.micro_batch_size=16",
            "data.task_size=200",
            "data.task_heldout=6",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
            "eval.every_n_steps=2",
            "eval.sets.heldout.path=null",
            "eval.sets.sampled.path=null",
            "eval.sets.sampled.n_samples=2",
            "eval.sets.sampled.temperature=1.0",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    evals = {r["step"]: r for r in rows if "eval/heldout/accuracy" in r}
    assert sorted(evals) == [0, 2, 4]
    for step, r in evals.items():
        version = r["eval/heldout/version"]
        # the engines' weights: never newer than the trainer's, at most one publish behind (max_staleness=1)
        assert r["policy_version"] - 1 <= version <= r["policy_version"], (step, version, r["policy_version"])
        # one version throughout the evaluation
        assert r["eval/heldout/sample_version_min"] == r["eval/heldout/sample_version_max"] == version
        assert r["eval/sampled/samples"] == 12 and r["eval/heldout/failed"] == r["eval/sampled/failed"] == 0
        lines = (tmp_path / "eval" / "heldout" / f"step_{int(step)}.jsonl").read_text().splitlines()
        completions = [json.loads(line) for line in lines]
        assert len(completions) == 6 and {c["version"] for c in completions} == {version}
    assert evals[0]["eval/heldout/version"] == 0
