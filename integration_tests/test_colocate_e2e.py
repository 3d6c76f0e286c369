"""End to end through real Ray with the real tiny model: colocate run, metrics files, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow

SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=8",
    "data.task_size=200",
    "logging.progress=false",
    "logging.console=false",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_colocate_run_writes_metrics_checkpoints_and_hf_model(ray_session, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None, [*SMALL, "total_steps=3", f"run_dir={run_dir}", "logging.wandb=true", "checkpoint.save_every=2"]
    )
    summary = run(cfg)
    assert summary["steps"] == 3
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in [
        "reward/mean",
        "reward/accuracy",
        "response/length_mean",
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "time/generate_s",
        "time/train_s",
        "time/sync_s",
        "perf/tokens_per_s",
    ]:
        assert key in rows[-1], key
    assert [r["policy_version"] for r in rows] == [1, 2, 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]
    assert any((run_dir / "wandb").rglob("*.wandb")), "no W&B offline run file"
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(summary["final_hf"])
    assert model.num_parameters() > 0


def test_resume_continues_exactly_like_an_uninterrupted_run(ray_session, tmp_path):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    common = [*SMALL, "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_hf_final=false"]
    run(load_config(None, [*common, "total_steps=4", f"run_dir={full_dir}"]))
    run(load_config(None, [*common, "total_steps=2", f"run_dir={split_dir}"]))
    run(load_config(None, [*common, "total_steps=4", f"run_dir={split_dir}", "checkpoint.resume=auto"]))
    full, split = _metrics(full_dir), _metrics(split_dir)
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(full, split, strict=True):
        for key in ["reward/mean", "response/length_mean", "train/loss", "train/grad_norm"]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
