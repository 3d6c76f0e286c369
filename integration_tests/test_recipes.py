"""Every algorithm recipe in examples/ through real Ray with the real tiny model (one shared Ray).

Smoke: each recipe runs 3 quick-start steps (4 prompts x 4 samples) with finite metrics and the
metrics its algorithm parts must produce. Learning: GRPO, Dr.GRPO, RLOO and PPO run 20 steps of
16 prompts x 8 samples (lr 5e-4, one mini-batch, no entropy bonus) and must lift the reward: the mean over the last 5 steps must
exceed the first step's (the untouched initial policy) by a clear margin. The learning runs check
finite metrics at every step too, so they also cover those recipes' smoke test.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES = [
    "grpo",
    "dr_grpo",
    "dapo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "ppo",
    "gspo",
    "sapo",
    "cispo",
    "m2po",
    "opd",
]
LEARNING = ["grpo", "dr_grpo", "rloo", "ppo"]
QUIET = [
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.save_every=0",
]
SMOKE = [
    *QUIET,
    "total_steps=3",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=16",
    "data.task_size=200",
]
LEARN = [
    *QUIET,
    "total_steps=20",
    "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=3",
    "trainer.lr=5e-4",
    "trainer.num_minibatches=1",
    "algorithm.entropy_coef=0.0",
    "trainer.lr_schedule=constant",
    "trainer.warmup_steps=0",
    "trainer.micro_batch_size=128",
    "data.task_size=500",
    "seed=0",
]
# what each recipe's algorithm parts must show in the last step's metrics
EXPECTED_KEYS = {
    "dapo": [
        "groups/dropped_uniform",
        "groups/extra_rounds",
        "reward/overlong_penalty_mean",
        "train/clip_frac_high",
    ],
    "reinforce_pp": ["kl/policy_ref"],
    "reinforce_pp_baseline": ["kl/policy_ref", "train/kl_loss"],
    "gspo": ["train/clip_frac"],
    "cispo": ["train/clip_frac_high"],
    "m2po": ["train/m2_before", "train/m2po_mask_frac"],
    "opd": ["kl/policy_teacher", "train/opd_reverse_kl"],
    "ppo": ["train/vf_loss", "train/vf_clip_frac", "critic/values_mean"],
}
COMMON_KEYS = [
    "reward/mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "rollout/train_logprob_abs_diff",
]


def _run(recipe: str, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    started = time.perf_counter()
    summary = run(load_config(EXAMPLES / f"{recipe}.yaml", [*overrides, f"run_dir={run_dir}"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(rows)
    return rows, time.perf_counter() - started


def _check_metrics(recipe: str, rows: list[dict]) -> None:
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{recipe} step {row['step']}: non-finite metrics {bad}"
    for key in COMMON_KEYS + EXPECTED_KEYS.get(recipe, []):
        assert key in rows[-1], f"{recipe}: metric {key!r} missing"


def test_every_quickstart_recipe_is_covered():
    recipes = set()
    for path in EXAMPLES.glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        own_inputs = (data.get("inputs") or {}).get(
            "name"
        )  # a model an inputs plugin builds (smollm2_eval), not the quick-start's
        if data["model"]["path"] is None and not own_inputs and not path.stem.startswith("quickstart"):
            recipes.add(path.stem)
    assert recipes == set(RECIPES)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A differently seeded model with the quick-start tokenizer: a teacher the student disagrees with."""
    from relax.core.quickstart_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in LEARNING])
def test_recipe_runs_three_steps(ray_session, tmp_path, teacher_dir, recipe):
    overrides = [*SMOKE]
    if recipe == "opd":
        overrides.append(f"algorithm.teacher_model_path={teacher_dir}")
    rows, seconds = _run(recipe, overrides, tmp_path / recipe)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    _check_metrics(recipe, rows)
    if recipe == "opd":
        assert rows[0]["train/opd_reverse_kl"] > 0.1  # the student really is scored by another model
    if recipe == "dapo":
        assert all(r["groups/kept"] == 4 or r["groups/extra_rounds"] == 4 for r in rows)
    print(f"{recipe}: 3 steps in {seconds:.1f}s")


@pytest.mark.parametrize("recipe", LEARNING)
def test_recipe_lifts_quickstart_reward(ray_session, tmp_path, recipe):
    rows, seconds = _run(recipe, LEARN, tmp_path / recipe)
    _check_metrics(recipe, rows)
    rewards = [r["reward/mean"] for r in rows]
    initial, final = rewards[0], sum(rewards[-5:]) / 5
    print(
        f"{recipe}: reward {initial:.3f} -> {final:.3f} (mean of last 5 of {len(rows)} steps) in {seconds:.1f}s"
    )
    assert final >= initial + 0.04, rewards


def test_remax_greedy_baseline_and_truncated_is(ray_session, tmp_path):
    """Estimator inputs no recipe uses: ReMax's extra greedy generation, TIS on the rollout logprobs."""
    overrides = [
        *SMOKE,
        "algorithm.advantage_estimator=remax",
        "algorithm.greedy_baseline=true",
        "algorithm.correction.is_mode=truncate",
    ]
    rows, _ = _run("grpo", overrides, tmp_path / "remax")
    _check_metrics("remax", rows)
    for key in [
        "reward/greedy_mean",
        "time/greedy_baseline_s",
        "train/is_clip_frac",
        "train/mismatch_abs_logprob_diff",
    ]:
        assert key in rows[-1], key
    assert all(0.0 <= r["reward/greedy_mean"] <= 1.0 for r in rows)
