"""Async and hybrid modes end to end through real Ray: equivalence, staleness bound, partial rollout."""

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
    "trainer.micro_batch_size=16",
    "data.task_size=200",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_with_zero_staleness_reproduces_colocate(ray_session, tmp_path):
    colocate, asynchronous = tmp_path / "colocate", tmp_path / "async"
    run(load_config(None, [*SMALL, "total_steps=3", f"run_dir={colocate}"]))
    run(
        load_config(
            None, [*SMALL, "total_steps=3", f"run_dir={asynchronous}", "mode=async", "max_staleness=0"]
        )
    )
    a, b = _metrics(colocate), _metrics(asynchronous)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in [
            "reward/mean",
            "response/length_mean",
            "train/loss",
            "train/pg_loss",
            "train/grad_norm",
            "train/entropy",
        ]:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
        assert rb["staleness/max"] == 0


@pytest.mark.parametrize(("mode", "staleness"), [("hybrid", 1)])  # async 2: its learning run below bounds it
def test_staleness_never_exceeds_the_bound(ray_session, tmp_path, mode, staleness):
    run_dir = tmp_path / mode
    cfg = load_config(
        None,
        [
            *SMALL,
            "total_steps=5",
            f"run_dir={run_dir}",
            f"mode={mode}",
            f"max_staleness={staleness}",
            "algorithm.kl.coef=0.01",
        ],
    )
    run(cfg)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness/max"] <= staleness for r in rows)
    assert max(r["staleness/max"] for r in rows) >= 1, "rollout never ran ahead of the trainer"
    assert all(r["policy_version"] == r["step"] for r in rows)
    assert "kl/policy_ref" in rows[-1] and rows[-1]["queue/capacity"] == (staleness + 2) * 16


def test_partial_rollout_spans_weight_updates_in_a_run(ray_session, tmp_path):
    """Generation (200 tokens, EOS ignored, 4 sequences at a time) outlasts a train step, so updates land
    mid-sequence (with the whole step decoding at once, the engine can finish before the trainer syncs)."""
    run_dir = tmp_path / "partial"
    cfg = load_config(
        None,
        [
            *SMALL,
            "total_steps=4",
            f"run_dir={run_dir}",
            "mode=async",
            "max_staleness=1",
            "rollout.max_new_tokens=200",
            "rollout.ignore_eos=true",
            "rollout.prompts_per_step=8",
            "rollout.engine_params.max_batch_size=4",
        ],
    )
    run(cfg)
    rows = _metrics(run_dir)
    assert sum(r["rollout/mixed_version_frac"] for r in rows) > 0, "no sequence spanned a weight update"
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert all(r["response/length_mean"] == 200 for r in rows)


@pytest.mark.parametrize(("mode", "staleness"), [("async", 2), ("hybrid", 1)])
def test_quickstart_learns_off_policy(ray_session, tmp_path, mode, staleness):
    """The bundled quick-start settings, run asynchronously: reward rises well above chance. Async at staleness
    2 (the staler case; staleness 1 is the partial-rollout run above and the async agent quick-start) and
    hybrid at 1."""
    run_dir = tmp_path / f"{mode}{staleness}"
    steps = (
        24 + 4 * staleness
    )  # staler data learns slower per step: async-2 rose only 0.14 in 24 steps once in CI
    cfg = load_config(
        None,
        [
            f"total_steps={steps}",
            f"run_dir={run_dir}",
            f"mode={mode}",
            f"max_staleness={staleness}",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    run(cfg)
    rows = _metrics(run_dir)
    first = sum(r["reward/mean"] for r in rows[:4]) / 4
    last = sum(r["reward/mean"] for r in rows[-4:]) / 4
    assert last > first + 0.15, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert all(r["staleness/max"] <= staleness for r in rows)
    assert max(r["staleness/max"] for r in rows) == staleness


def test_async_resume_continues_from_the_trained_position(ray_session, tmp_path):
    """The producer runs ahead of training (staleness 1), so a checkpoint must record the *trained*
    data position: resuming from step 2 trains exactly the groups the uninterrupted run trained at
    steps 3 and 4 -- none skipped, none repeated."""
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    common = [*SMALL, "mode=async", "max_staleness=1", "total_steps=4", "checkpoint.keep_last=3"]
    run(load_config(None, [*common, f"run_dir={full_dir}", "checkpoint.save_every=2"]))
    checkpoint = full_dir / "checkpoints" / "step_000002"
    run(load_config(None, [*common, f"run_dir={resumed_dir}", f"checkpoint.resume={checkpoint}"]))
    full, resumed = _metrics(full_dir), _metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [3, 4]
    assert max(r["staleness/max"] for r in full) == 1, "rollout never ran ahead of training"
    for a, b in zip(full[2:], resumed, strict=True):
        assert (a["data/group_id_min"], a["data/group_id_max"]) == (
            b["data/group_id_min"],
            b["data/group_id_max"],
        )
    assert [r["data/group_id_min"] for r in full] == [0, 4, 8, 12]
