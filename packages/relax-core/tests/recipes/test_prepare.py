"""``relax data prepare``'s machinery on the toy plugin's dataset: sources (a file, a directory, a Hub id's
shape), the per-reason skip report, exit codes, held-out rows chosen by hash, media sniffing, and a recipe run
before its data was prepared naming the command that prepares it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from toy_recipes import TEMPLATE  # tests/recipes/toy_recipes.py, on sys.path by conftest

from relax.core.cli import main
from relax.core.recipes import prepare, prepare_smoke
from relax.core.recipes.fixtures import squares_png, tone_wav
from relax.core.recipes.output import media_extension
from relax.core.recipes.sources import SourceError, is_hub_id


def rows_of(report) -> list[dict]:
    return [json.loads(line) for line in Path(report.path).read_text().splitlines()]


def test_smoke_then_source_on_the_command_line(toy_recipes, tmp_path, capsys):
    assert main(["data", "prepare", "toy-grpo", "--smoke", "--rows", "4", "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out  # a recipe's name prepares its dataset
    assert f"toy-sums: wrote 4 rows to {tmp_path / 's' / 'train.jsonl'}" in out
    assert (
        "skipped 1: no question" in out and "skipped 1: no answer (e.g. toy.jsonl:6: question '9+9')" in out
    )
    assert "used by toy-grpo (examples/toy.yaml)" in out
    source = str(tmp_path / "s" / "source")
    assert (
        main(
            ["data", "prepare", "toy-sums", "--source", source, "--out", str(tmp_path / "a"), "--limit", "3"]
        )
        == 0
    )
    assert rows_of(prepare("toy-sums", source, tmp_path / "b", limit=3)) == [
        {"prompt": f"{i}+{i}", "label": str(2 * i)} for i in range(3)
    ]


def test_bad_invocations_exit_2_and_say_why(toy_recipes, tmp_path, capsys):
    assert main(["data", "prepare", "toy-sums"]) == 2
    assert "give --source (a directory, a file or a Hub id such as owner/toy-sums)" in capsys.readouterr().err
    assert main(["data", "prepare", "toy-sums", "--smoke", "--source", "x"]) == 2
    assert main(["data", "prepare", "toy-sums", "--source", str(tmp_path / "nowhere")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["data", "prepare", "toy-sums", "--source", str(tmp_path), "--heldout", "-1"]) == 2
    assert "--heldout must be >= 0, got -1" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .parquet/.jsonl/.json files"):
        prepare("toy-sums", str(tmp_path / "empty"), tmp_path / "out")
    assert not (tmp_path / "out" / "train.jsonl").exists()  # nothing half-written
    assert is_hub_id("owner/toy-sums") and not is_hub_id(str(tmp_path / "empty"))


def test_nothing_convertible_exits_1_and_bad_lines_are_counted(toy_recipes, tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"question": ""}) + "\n{not json\n" + json.dumps(["a"]) + "\n")
    assert main(["data", "prepare", "toy-sums", "--source", str(src), "--out", str(tmp_path / "o")]) == 1
    assert "no row could be converted" in capsys.readouterr().err
    report = json.loads((tmp_path / "o" / "prepare_report.json").read_text())
    assert report["skipped"] == {"no question": 1, "row is not a JSON object": 2}
    assert report["examples"]["row is not a JSON object"][0].startswith("rows.jsonl:2: invalid JSON")


def test_heldout_rows_are_chosen_by_hash_never_trained_on(toy_recipes, tmp_path):
    """``--heldout N``: N rows out of train.jsonl into heldout.jsonl, the same rows whatever the file's order."""
    report = prepare_smoke("toy-sums", tmp_path / "a", rows=12, heldout=3)
    train, held = (
        rows_of(report),
        [json.loads(x) for x in (tmp_path / "a" / "heldout.jsonl").read_text().splitlines()],
    )
    assert report.rows == len(train) == 12 and report.heldout == len(held) == 3
    assert sorted(int(r["label"]) for r in train + held) == [2 * i for i in range(15)]
    saved = json.loads((tmp_path / "a" / "prepare_report.json").read_text())
    assert saved["heldout"] == 3 and saved["heldout_path"] == str(tmp_path / "a" / "heldout.jsonl")
    src = tmp_path / "reversed.jsonl"  # the same rows in another order, as another copy may be
    src.write_text(
        "".join(
            json.dumps({"question": r["prompt"], "answer": r["label"]}) + "\n" for r in [*train, *held][::-1]
        )
    )
    prepare("toy-sums", str(src), tmp_path / "b", heldout=3)
    again = [json.loads(x) for x in (tmp_path / "b" / "heldout.jsonl").read_text().splitlines()]
    assert sorted(again, key=str) == sorted(held, key=str)  # the same rows (in the file's own order)


def test_unprepared_recipe_data_names_the_command(toy_recipes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy.yaml").write_text(TEMPLATE.replace("models/Toy-1B", "null"))
    assert main(["validate", "toy.yaml"]) == 2
    err = capsys.readouterr().err
    assert (
        "data.path: 'data/toy-sums/train.jsonl' does not exist -- make it with: relax data prepare toy-sums "
        "--source owner/toy-sums --heldout 2\n"
    ) in err
    assert main(["validate", "toy.yaml", "data.path=/elsewhere/toy-sums/train.jsonl"]) == 2
    assert "--source owner/toy-sums --out /elsewhere/toy-sums --heldout 2" in capsys.readouterr().err


def test_media_sniffing():
    assert (
        media_extension(squares_png(2), "image") == ".png"
        and media_extension(squares_png(2), "audio") is None
    )
    assert (
        media_extension(tone_wav(440.0), "audio") == ".wav"
        and media_extension(tone_wav(440.0), "image") is None
    )
    assert media_extension(b"\xff\xd8\xff\xe0rest", "image") == ".jpg"
