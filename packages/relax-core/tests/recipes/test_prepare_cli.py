"""``relax data prepare`` on the command line: exit codes, the printed report, and a recipe run before its
dataset was prepared names the command that prepares it."""

from __future__ import annotations

import json
from pathlib import Path

from relax.core.cli import main

REPO = Path(__file__).resolve().parents[4]


def test_smoke_then_source(tmp_path, capsys):
    assert main(["data", "prepare", "avqa-r1-6k", "--smoke", "--out", str(tmp_path / "smoke")]) == 0
    out = capsys.readouterr().out
    assert f"avqa-r1-6k: wrote 8 rows to {tmp_path / 'smoke' / 'train.jsonl'}" in out
    assert "skipped 1: answer is not one of the options" in out and "avqa-omni-grpo" in out
    # the fixture's published tarball, converted again from --source: same rows
    assert (
        main(
            [
                "data",
                "prepare",
                "avqa-r1-6k",
                "--source",
                str(tmp_path / "smoke" / "source"),
                "--out",
                str(tmp_path / "again"),
                "--limit",
                "5",
            ]
        )
        == 0
    )
    rows = (tmp_path / "again" / "train.jsonl").read_text().splitlines()
    assert rows == (tmp_path / "smoke" / "train.jsonl").read_text().splitlines()[:5]


def test_bad_invocations_exit_2_and_say_why(tmp_path, capsys):
    assert main(["data", "prepare", "dapo-math-17k"]) == 2
    assert (
        "give --source (a directory, a file or a Hub id such as BytedTsinghua-SIA/DAPO-Math-17k)"
        in capsys.readouterr().err
    )
    assert main(["data", "prepare", "dapo-math-17k", "--smoke", "--source", "x"]) == 2
    assert main(["data", "prepare", "gsm8k", "--smoke"]) == 2
    assert "unknown recipe or dataset 'gsm8k'" in capsys.readouterr().err
    assert main(["data", "prepare", "dapo-math-17k", "--source", str(tmp_path / "nowhere")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_nothing_convertible_exits_1(tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": [], "reward_model": {"ground_truth": "1"}}) + "\n")
    assert main(["data", "prepare", "dapo-math-17k", "--source", str(src), "--out", str(tmp_path / "o")]) == 1
    assert "no row could be converted" in capsys.readouterr().err


def test_unprepared_recipe_data_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(REPO / "examples" / "omni" / "qwen3_omni_30b_a3b_grpo.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        "data.path: 'data/avqa-r1-6k/train.jsonl' does not exist -- make it with: relax data prepare "
        "avqa-r1-6k --source harryhsing/AVQA-R1-6K\n"
    ) in err
    assert (
        main(
            [
                "validate",
                str(REPO / "examples" / "qwen3_4b_grpo_math.yaml"),
                "data.path=/elsewhere/dapo-math-17k/train.jsonl",
            ]
        )
        == 2
    )
    assert (
        "--source BytedTsinghua-SIA/DAPO-Math-17k --out /elsewhere/dapo-math-17k" in capsys.readouterr().err
    )


def test_heldout_and_split_on_the_command_line(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "prepare",
                "dapo-math-17k",
                "--smoke",
                "--rows",
                "6",
                "--heldout",
                "2",
                "--out",
                str(tmp_path / "d"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "wrote 6 rows" in out
        and f"held out 2 rows (never in train.jsonl) in {tmp_path / 'd' / 'heldout.jsonl'}" in out
    )
    assert main(["data", "prepare", "avqa-r1-6k", "--source", str(tmp_path / "a"), "--heldout", "-1"]) == 2
    assert "--heldout must be >= 0, got -1" in capsys.readouterr().err
    main(["data", "prepare", "avqa-r1-6k", "--smoke", "--out", str(tmp_path / "a")])
    assert (
        main(
            [
                "data",
                "prepare",
                "avqa-r1-6k",
                "--source",
                str(tmp_path / "a" / "source"),
                "--split",
                "valid",
                "--out",
                str(tmp_path / "v"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"wrote 2 rows to {tmp_path / 'v' / 'valid.jsonl'}" in out and "prepare_report.valid.json" in out


def test_unprepared_eval_set_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "dapo-math-17k").mkdir(parents=True)
    (tmp_path / "data" / "dapo-math-17k" / "train.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    assert main(["validate", str(REPO / "examples" / "qwen3_4b_grpo_math.yaml")]) == 2
    assert (
        "eval.sets.heldout.path: 'data/dapo-math-17k/heldout.jsonl' does not exist -- make it with: relax data "
        "prepare dapo-math-17k --source BytedTsinghua-SIA/DAPO-Math-17k --heldout 500"
    ) in capsys.readouterr().err
    assert main(["validate", str(REPO / "examples" / "omni" / "qwen3_omni_30b_a3b_grpo.yaml")]) == 2
    assert (
        "relax data prepare avqa-r1-6k --source harryhsing/AVQA-R1-6K --split valid"
        in capsys.readouterr().err
    )
