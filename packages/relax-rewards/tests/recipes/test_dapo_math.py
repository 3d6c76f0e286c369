"""relax-rewards' text math recipes (``dapo-math-grpo``, ``dapo-math-ppo``) and their dataset (DAPO-Math-17k,
converted from its published Parquet schema, offline on fixture rows): registered through core's recipe hooks,
checked with core's recipe kit (``relax.core.testing.recipes``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.cli import main
from relax.core.config import load_config
from relax.core.recipes import prepare, prepare_smoke, recipes
from relax.core.testing import recipes as kit

REPO = Path(__file__).resolve().parents[4]
OURS = ("dapo-math-grpo", "dapo-math-ppo")


def rows_of(report) -> list[dict]:
    return [json.loads(line) for line in Path(report.path).read_text().splitlines()]


@pytest.mark.parametrize("name", OURS)
def test_recipe_is_registered_and_its_configs_hold(name):
    assert recipes()[name].package == "relax-rewards"
    kit.check_example_is_the_template(name, REPO)
    kit.check_offered_modes_validate(name)
    kit.check_smoke_variant_changes_only_sizes(name, REPO)


def test_published_parquet(tmp_path):
    report = prepare_smoke("dapo-math-17k", tmp_path / "out", rows=5)
    rows = rows_of(report)
    assert report.rows == len(rows) == 5 and report.duplicates == 1
    assert report.skipped == {
        "no answer (reward_model.ground_truth)": 1,
        "prompt is not a chat message list": 1,
    }
    assert report.examples["prompt is not a chat message list"] == [
        "data/dapo-math-17k.parquet:8: empty list"
    ]
    first = rows[0]
    assert first["label"] == "7" and first["data_source"] == "math_dapo" and first["index"] == "fixture-0000"
    assert first["prompt"][0]["role"] == "user" and "What is 3+4?" in first["prompt"][0]["content"]
    assert (
        first["prompt"][0]["content"].rstrip().endswith('after "Answer:".')
    )  # the published wrapper, untouched
    kit.check_dataset_converts_its_fixture("dapo-math-17k", tmp_path / "kit")


def test_flat_jsonl_copies_convert_too(tmp_path):
    src = tmp_path / "dapo.jsonl"
    lines = [{"prompt": "What is 2+2?", "label": "4"}, {"prompt": "What is 5+5?", "label": 10}]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = prepare("dapo-math-17k", str(src), tmp_path / "out")
    assert [r["label"] for r in rows_of(report)] == ["4", "10"]
    assert rows_of(report)[0]["prompt"] == [{"role": "user", "content": "What is 2+2?"}]


def test_init_and_prepare_on_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--recipe", "dapo-math-ppo", "--out", "cfg/ppo.yaml"]) == 0
    assert (
        "relax data prepare dapo-math-17k --source BytedTsinghua-SIA/DAPO-Math-17k" in capsys.readouterr().out
    )
    assert load_config(tmp_path / "cfg" / "ppo.yaml").algorithm.critic.enable
    assert main(["init", "--list"]) == 0
    assert "dapo-math-grpo       relax-rewards  Qwen/Qwen3-4B on dapo-math-17k" in capsys.readouterr().out
    assert main(["data", "prepare", "dapo-math-grpo", "--smoke", "--rows", "6", "--heldout", "2"]) == 0
    out = capsys.readouterr().out  # a recipe's name prepares its dataset, where the recipes look
    assert "wrote 6 rows to data/dapo-math-17k-smoke/train.jsonl" in out and "held out 2 rows" in out


def test_unprepared_eval_set_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "dapo-math-17k").mkdir(parents=True)
    (tmp_path / "data" / "dapo-math-17k" / "train.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    assert main(["validate", str(REPO / "examples" / "qwen3_4b_grpo_math.yaml")]) == 2
    assert (
        "eval.sets.heldout.path: 'data/dapo-math-17k/heldout.jsonl' does not exist -- make it with: relax data "
        "prepare dapo-math-17k --source BytedTsinghua-SIA/DAPO-Math-17k --heldout 500"
    ) in capsys.readouterr().err
