"""``relax data prepare``: each published dataset's schema -> Relax rows + media, offline, on fixture rows
written in that schema (Parquet / JSON / tarball as published); malformed rows are skipped with reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.recipes import DATASETS, dataset_of, prepare, prepare_smoke
from relax.core.recipes.output import media_extension
from relax.core.recipes.sources import SourceError, is_hub_id


def rows_of(report) -> list[dict]:
    return [json.loads(line) for line in Path(report.path).read_text().splitlines()]


def test_dapo_math_published_parquet(tmp_path):
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
    saved = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert saved["rows"] == 5 and saved["duplicates"] == 1


def test_dapo_math_flat_jsonl_and_bad_lines(tmp_path):
    src = tmp_path / "dapo.jsonl"
    src.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "What is 2+2?", "label": "4"}),
                "{not json",
                json.dumps(["a", "list"]),
                json.dumps({"prompt": "What is 5+5?", "label": 10}),
            ]
        )
        + "\n"
    )
    report = prepare("dapo-math-17k", str(src), tmp_path / "out")
    assert [r["label"] for r in rows_of(report)] == ["4", "10"]
    assert rows_of(report)[0]["prompt"] == [{"role": "user", "content": "What is 2+2?"}]
    assert report.skipped == {"row is not a JSON object": 2}
    assert report.examples["row is not a JSON object"][0].startswith("dapo.jsonl:2: invalid JSON")


def test_limit_and_recipe_names_resolve(tmp_path):
    report = prepare_smoke("dapo-math-grpo", tmp_path / "a", rows=8)  # a recipe's name -> its dataset
    assert report.dataset == "dapo-math-17k"
    limited = prepare("dapo-math-17k", str(tmp_path / "a" / "source"), tmp_path / "b", limit=3)
    assert limited.rows == 3
    with pytest.raises(KeyError, match="unknown recipe or dataset 'gsm8k'"):
        dataset_of("gsm8k")


def test_openr1_images_extracted_by_content(tmp_path):
    report = prepare_smoke("multimodal-open-r1-8k-verified", tmp_path / "out", rows=6)
    rows = rows_of(report)
    assert report.rows == 6 and report.media == {"image": 4}  # 1..4 squares: rows 5 and 6 reuse two images
    assert report.skipped == {
        "image is not a PNG/JPEG/GIF/WEBP/BMP file": 1,
        "no solution": 1,
        "no problem text": 1,
    }
    (message,) = rows[0]["messages"]
    image, text = message["content"]
    assert image["type"] == "image" and text == {
        "type": "text",
        "text": "how many squares are in the image? (0)",
    }
    assert rows[0]["label"] == "<answer>1</answer>" and rows[1]["label"] == "2"
    data = (tmp_path / "out" / image["image"]).read_bytes()
    assert not Path(image["image"]).is_absolute() and media_extension(data, "image") == ".png"


def test_openr1_decoded_pil_images_from_datasets(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from relax.core.recipes.openr1_vl import image_bytes

    picture = Image.new("RGB", (20, 10), "red")  # what datasets.load_dataset hands over
    assert media_extension(image_bytes(picture, None), "image") == ".png"
    with pytest.raises(ValueError, match="image is missing"):
        image_bytes(None, None)


@pytest.mark.parametrize("archive", [True, False], ids=["tarball", "unpacked"])
def test_avqa_published_layout(tmp_path, archive):
    from relax.core.recipes.avqa import write_fixture

    source = write_fixture(tmp_path / "src", rows=4, archive=archive)
    if not archive:
        source = source / "AVQA_R1"
    report = prepare("avqa-r1-6k", str(source), tmp_path / "out")
    rows = rows_of(report)
    assert report.rows == 4 and report.media == {"image": 4, "audio": 3}
    assert set(report.skipped) == {
        "answer is not one of the options",
        "audio file missing",
        "options are not a list of at least two texts",
    }
    row = rows[1]
    assert row["label"] == "B" and row["options"] == {
        "A": "street",
        "B": "kitchen",
        "C": "forest",
        "D": "beach",
    }
    kinds = [item["type"] for item in row["messages"][0]["content"]]
    assert kinds == ["image", "audio", "text"]
    text = row["messages"][0]["content"][2]["text"]
    assert (
        text.startswith("Where does the video take place?\nOptions:\nA. street\n") and '"Answer: X"' in text
    )
    audio = (tmp_path / "out" / row["messages"][0]["content"][1]["audio"]).read_bytes()
    assert media_extension(audio, "audio") == ".wav"
    assert (tmp_path / "out" / ".source" / "AVQA_R1").is_dir() == archive  # the tarball is unpacked once


def test_avqa_options_and_answers():
    from relax.core.recipes.avqa import answer_letter, options_of
    from relax.core.recipes.output import RowError

    assert options_of(["A. cat", "B. dog"]) == {"A": "cat", "B": "dog"}
    assert options_of(["cat", "dog", "eel"]) == {"A": "cat", "B": "dog", "C": "eel"}  # unlettered
    assert answer_letter("<answer> c </answer>", {"A": "x", "B": "y", "C": "z"}) == "C"
    assert answer_letter("dog", {"A": "cat", "B": "dog"}) == "B"  # the option's text
    with pytest.raises(RowError, match="answer is not one of the options"):
        answer_letter("<answer>D</answer>", {"A": "cat", "B": "dog"})


def test_unreadable_sources_are_named(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory"):
        prepare("dapo-math-17k", str(tmp_path / "missing"), tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .parquet/.jsonl/.json files"):
        prepare("dapo-math-17k", str(tmp_path / "empty"), tmp_path / "out")
    with pytest.raises(SourceError, match="omni_rl_format_train.json"):
        prepare("avqa-r1-6k", str(tmp_path / "empty"), tmp_path / "out2")
    assert not (tmp_path / "out" / "train.jsonl").exists()  # nothing half-written
    assert is_hub_id("lmms-lab/multimodal-open-r1-8k-verified") and not is_hub_id(str(tmp_path / "empty"))


def test_media_sniffing():
    from relax.core.recipes.fixtures import squares_png, tone_wav

    assert (
        media_extension(squares_png(2), "image") == ".png"
        and media_extension(squares_png(2), "audio") is None
    )
    assert (
        media_extension(tone_wav(440.0), "audio") == ".wav"
        and media_extension(tone_wav(440.0), "image") is None
    )
    assert media_extension(b"\xff\xd8\xff\xe0rest", "image") == ".jpg"


def test_every_dataset_converts_its_fixture(tmp_path):
    for name, spec in DATASETS.items():
        report = prepare_smoke(name, tmp_path / name, rows=2)
        assert report.rows == 2 and sum(report.skipped.values()) >= 2, (name, report)
        assert spec.reward in ("math", "openr1_mm", "multiple_choice")


def test_heldout_rows_are_chosen_by_hash_never_trained_on(tmp_path):
    """``--heldout N``: N rows out of train.jsonl into heldout.jsonl, the same rows whatever the file's order."""
    from relax.core.recipes.dapo_math import write_fixture

    write_fixture(tmp_path / "src", 12)
    report = prepare("dapo-math-17k", str(tmp_path / "src"), tmp_path / "out", heldout=3)
    train, held = (
        rows_of(report),
        [json.loads(x) for x in (tmp_path / "out" / "heldout.jsonl").read_text().splitlines()],
    )
    assert report.rows == len(train) == 9 and report.heldout == len(held) == 3 and report.duplicates == 1
    assert not {json.dumps(r) for r in train} & {json.dumps(r) for r in held}
    assert sorted(r["index"] for r in train + held) == sorted(f"fixture-{i:04d}" for i in range(12))
    saved = json.loads((tmp_path / "out" / "prepare_report.json").read_text())
    assert saved["heldout"] == 3 and saved["heldout_path"] == str(tmp_path / "out" / "heldout.jsonl")
    # the same source reversed (as another copy of the dataset might be ordered): the same rows held out
    src = tmp_path / "reversed.jsonl"
    src.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in [*train, *held][::-1]
        )
    )
    again = prepare("dapo-math-17k", str(src), tmp_path / "again", heldout=3)
    held_again = (tmp_path / "again" / "heldout.jsonl").read_text().splitlines()
    assert again.heldout == 3 and {
        json.loads(x)["label"] + json.loads(x)["prompt"][0]["content"] for x in held_again
    } == {r["label"] + r["prompt"][0]["content"] for r in held}


def test_avqa_valid_split_is_its_heldout_file(tmp_path):
    report = prepare_smoke("avqa-r1-6k", tmp_path / "out", rows=4, heldout=2)
    assert report.rows == 4 and Path(report.path).name == "train.jsonl"
    valid = [json.loads(x) for x in (tmp_path / "out" / "valid.jsonl").read_text().splitlines()]
    assert len(valid) == 2 and all("(valid" in r["messages"][0]["content"][2]["text"] for r in valid)
    assert all((tmp_path / "out" / r["messages"][0]["content"][1]["audio"]).is_file() for r in valid)
    saved = json.loads((tmp_path / "out" / "prepare_report.valid.json").read_text())
    assert saved["rows"] == 2 and saved["path"].endswith("valid.jsonl")
    assert not (tmp_path / "out" / "heldout.jsonl").exists()  # a published split, nothing carved
