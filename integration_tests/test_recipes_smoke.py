"""The three recipes end to end on CPU: each smoke variant (examples/recipes/*_smoke.yaml) builds its tiny model
and its dataset's fixture rows -- written in the published schema, converted by ``relax data prepare``'s
converter -- on first use (``inputs``), then trains a few steps (in the driver's process) with the recipe's own algorithm,
reward and data format (dapo-math PPO with its critic too). Before that, without Ray, the converted rows
are scored by the reward each recipe routes them to: the right answer scores 1, a wrong one 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.hosting import in_driver
from relax.core.controller.run import run
from relax.core.plugins import get_plugin_manager
from relax.core.recipes import datasets, prepare_smoke, recipes

RECIPES, DATASETS = recipes(), datasets()  # relax-rewards' text math ones, relax-omni's media ones

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
QUIET = ["logging.progress=false", "logging.console=false"]
MEDIA_ROOT = "data.processor_params.media_root"


def converted(name: str, tmp_path: Path) -> list[dict]:
    report = prepare_smoke(name, tmp_path / name, rows=4)
    return [json.loads(line) for line in Path(report.path).read_text().splitlines()]


def test_converted_rows_score_with_their_reward(tmp_path):
    from relax.rewards.choice import ChoiceParams, choice_score
    from relax.rewards.mathverify import MathParams, math_score
    from relax.rewards.openr1 import OpenR1Params, openr1_score

    dapo = converted("dapo-math-17k", tmp_path)[0]  # "What is 3+4?"
    assert math_score("3 and 4 make 7.\nAnswer: 7", dapo["label"], {}, MathParams())["acc"] == 1.0
    assert math_score("Answer: 8", dapo["label"], {}, MathParams())["acc"] == 0.0
    wrapped, plain = converted("multimodal-open-r1-8k-verified", tmp_path)[:2]  # "<answer>1</answer>", "2"
    good = openr1_score("<think>one square</think><answer>1</answer>", wrapped["label"], {}, OpenR1Params())
    assert good == {"score": 2.0, "acc": 1.0, "format": 1.0}
    assert (
        openr1_score("<think>two</think><answer>2</answer>", plain["label"], {}, OpenR1Params())["acc"] == 1.0
    )
    assert (
        openr1_score("<think>two</think><answer>3</answer>", plain["label"], {}, OpenR1Params())["acc"] == 0.0
    )
    avqa = converted("avqa-r1-6k", tmp_path)[2]  # correct option C
    meta = {"options": avqa["options"]}
    assert choice_score("It sounds like three.\nAnswer: C", avqa["label"], meta, ChoiceParams())["acc"] == 1.0
    assert choice_score("Answer: A", avqa["label"], meta, ChoiceParams())["acc"] == 0.0


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_passes_relax_validate(tmp_path, recipe, capsys):
    """The GPU-sized config as ``relax validate`` checks it (paths, plugins' typed sections, placement), its
    model and data pointed at local stand-ins: the tiny model its smoke inputs build and its converted fixture
    rows."""
    from relax.core.cli import main

    spec = DATASETS[RECIPES[recipe].dataset]
    data = Path(prepare_smoke(spec.name, tmp_path / "data", rows=2, heldout=2).path)
    smoke = get_plugin_manager().registration("inputs", f"{spec.name}-smoke")
    model = smoke.factory(smoke.config(rows=2), None)["model.path"]  # the plugin's tiny model (cached)
    fills = smoke.options["fills"]
    media = [f"data.processor_params.media_root={data.parent}"] if MEDIA_ROOT in fills else []
    argv = [
        "validate",
        str(REPO / RECIPES[recipe].example),
        f"model.path={model}",
        f"data.path={data}",
        f"eval.sets.heldout.path={data.parent / spec.heldout_file}",
        f"run_dir={tmp_path / 'run'}",
        *media,
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out


# what each smoke run's last step must report besides the common keys: its reward's components, its media
EXPECTED = {
    "dapo-math-grpo": {"reward/math/parsed_mean"},
    "dapo-math-ppo": {"reward/math/parsed_mean", "critic/values_mean", "train/vf_loss"},
    "openr1-vl-grpo": {"reward/openr1_mm/format_mean", "data/media_image"},
    "avqa-omni-grpo": {"reward/parsed_mean", "data/media_image", "data/media_audio"},
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_smoke_variant_runs(tmp_path, recipe):
    spec = RECIPES[recipe]
    cfg = load_config(REPO / spec.smoke, [*QUIET, f"run_dir={tmp_path / 'run'}"], check_paths=True)
    assert in_driver(
        cfg
    )  # colocate with a reward declared in_driver (relax-rewards'): every role here, no Ray
    assert Path(cfg.data.path).parent.name.startswith(f"{spec.dataset}-smoke")  # inputs built it
    model_type = json.loads((Path(cfg.model.path) / "config.json").read_text())["model_type"]
    if (
        recipe == "avqa-omni-grpo"
    ):  # an Omni recipe's model comes whole (thinker, talker): so does the smoke's
        assert model_type == "qwen3_omni_moe", model_type
    report = json.loads((Path(cfg.data.path).parent / "prepare_report.json").read_text())
    assert (
        report["rows"] == 8 and sum(report["skipped"].values()) >= 2
    )  # the malformed fixture rows were skipped
    heldout = [json.loads(line) for line in Path(cfg.eval.sets["heldout"].path).read_text().splitlines()]
    assert len(heldout) == 2 and Path(cfg.eval.sets["heldout"].path).parent == Path(cfg.data.path).parent
    summary = run(cfg)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in logged if "eval/heldout/accuracy" in r}
    assert sorted(evals) == [0, cfg.total_steps], (
        f"{recipe}: evaluated at {sorted(evals)}"
    )  # before_train, at_end
    assert all(r["eval/heldout/prompts"] == 2 and r["eval/heldout/failed"] == 0 for r in evals.values()), (
        evals
    )
    rows = [r for r in logged if r["step"] > 0]
    assert summary["steps"] == cfg.total_steps == len(rows)
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{recipe} step {row['step']}: non-finite {bad}"
    last = rows[-1]
    missing = (
        {"reward/mean", "train/loss", "train/grad_norm", "rollout/train_logprob_abs_diff"} | EXPECTED[recipe]
    ) - set(last)
    assert not missing, f"{recipe}: missing metrics {missing}"
    assert last["reward/failures"] == 0.0
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    assert last["groups/kept"] == cfg.rollout.prompts_per_step and batch == 16
    if "data/media_image" in EXPECTED[recipe]:
        assert last["data/media_image"] >= cfg.rollout.prompts_per_step and last["data/skipped_media"] == 0
