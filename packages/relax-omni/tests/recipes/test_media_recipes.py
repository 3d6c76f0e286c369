"""relax-omni's media recipes (``openr1-vl-grpo``, ``avqa-omni-grpo``) and their datasets, converted from the
schemas they are published in (Parquet with image structs; a tarball of JSON, JPEG and WAV), offline on fixture
rows: registered through core's recipe hooks, checked with core's recipe kit (``relax.core.testing.recipes``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.cli import main
from relax.core.plugins import get_plugin_manager
from relax.core.recipes import RowError, media_extension, prepare, prepare_smoke, recipes
from relax.core.testing import recipes as kit
from relax.omni.recipes.avqa import answer_letter, options_of, write_fixture
from relax.omni.recipes.openr1_vl import image_bytes

REPO = Path(__file__).resolve().parents[4]
OURS = ("openr1-vl-grpo", "avqa-omni-grpo")


def rows_of(report) -> list[dict]:
    return [json.loads(line) for line in Path(report.path).read_text().splitlines()]


@pytest.mark.parametrize("name", OURS)
def test_recipe_is_registered_and_its_configs_hold(name):
    assert recipes()[name].package == "relax-omni"
    kit.check_example_is_the_template(name, REPO)
    kit.check_offered_modes_validate(name)
    kit.check_smoke_variant_changes_only_sizes(name, REPO)
    inputs = get_plugin_manager().registration("inputs", f"{recipes()[name].dataset}-smoke")
    assert "data.processor_params.media_root" in inputs.options["fills"] and inputs.plugin == "omni"


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
    kit.check_dataset_converts_its_fixture("multimodal-open-r1-8k-verified", tmp_path / "kit")


def test_openr1_decoded_pil_images_from_datasets():
    from PIL import Image

    picture = Image.new("RGB", (20, 10), "red")  # what datasets.load_dataset hands over
    assert media_extension(image_bytes(picture, None), "image") == ".png"
    with pytest.raises(ValueError, match="image is missing"):
        image_bytes(None, None)


@pytest.mark.parametrize("archive", [True, False], ids=["tarball", "unpacked"])
def test_avqa_published_layout(tmp_path, archive):
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
    assert [item["type"] for item in row["messages"][0]["content"]] == ["image", "audio", "text"]
    text = row["messages"][0]["content"][2]["text"]
    assert (
        text.startswith("Where does the video take place?\nOptions:\nA. street\n") and '"Answer: X"' in text
    )
    audio = (tmp_path / "out" / row["messages"][0]["content"][1]["audio"]).read_bytes()
    assert media_extension(audio, "audio") == ".wav"
    assert (tmp_path / "out" / ".source" / "AVQA_R1").is_dir() == archive  # the tarball is unpacked once


def test_avqa_options_and_answers(tmp_path):
    assert options_of(["A. cat", "B. dog"]) == {"A": "cat", "B": "dog"}
    assert options_of(["cat", "dog", "eel"]) == {"A": "cat", "B": "dog", "C": "eel"}  # unlettered
    assert answer_letter("<answer> c </answer>", {"A": "x", "B": "y", "C": "z"}) == "C"
    assert answer_letter("dog", {"A": "cat", "B": "dog"}) == "B"  # the option's text
    with pytest.raises(RowError, match="answer is not one of the options"):
        answer_letter("<answer>D</answer>", {"A": "cat", "B": "dog"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="omni_rl_format_train.json"):
        prepare("avqa-r1-6k", str(tmp_path / "empty"), tmp_path / "out")


def test_avqa_valid_split_is_its_heldout_file(tmp_path):
    report = prepare_smoke("avqa-r1-6k", tmp_path / "out", rows=4, heldout=2)
    assert report.rows == 4 and Path(report.path).name == "train.jsonl"
    valid = [json.loads(x) for x in (tmp_path / "out" / "valid.jsonl").read_text().splitlines()]
    assert len(valid) == 2 and all("(valid" in r["messages"][0]["content"][2]["text"] for r in valid)
    assert all((tmp_path / "out" / r["messages"][0]["content"][1]["audio"]).is_file() for r in valid)
    assert not (tmp_path / "out" / "heldout.jsonl").exists()  # a published split, nothing carved


def test_the_command_line(tmp_path, monkeypatch, capsys):
    smoke = tmp_path / "smoke"
    assert main(["data", "prepare", "avqa-r1-6k", "--smoke", "--out", str(smoke)]) == 0
    out = capsys.readouterr().out
    assert f"avqa-r1-6k: wrote 8 rows to {smoke / 'train.jsonl'}" in out and "used by avqa-omni-grpo" in out
    argv = ["data", "prepare", "avqa-r1-6k", "--source", str(smoke / "source"), "--split", "valid"]
    assert main([*argv, "--out", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    assert f"wrote 2 rows to {tmp_path / 'v' / 'valid.jsonl'}" in out and "prepare_report.valid.json" in out
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--recipe", "avqa-omni-grpo", "--mode", "colocate"]) == 2
    assert "written for mode async or hybrid" in capsys.readouterr().err
    assert main(["validate", str(REPO / "examples" / "omni" / "qwen3_omni_30b_a3b_grpo.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        "data.path: 'data/avqa-r1-6k/train.jsonl' does not exist -- make it with: relax data prepare "
        "avqa-r1-6k --source harryhsing/AVQA-R1-6K\n"
    ) in err
    assert "relax data prepare avqa-r1-6k --source harryhsing/AVQA-R1-6K --split valid" in err
