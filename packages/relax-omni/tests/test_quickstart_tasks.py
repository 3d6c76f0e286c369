"""The quick-starts' generated tasks show what their answers say: the shape's colour, the tone's band, the way the
video fades (with the same mean brightness both ways, so only time order tells them apart)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from relax.omni import synthetic


@pytest.mark.parametrize("answer", [1, 2, 3])
def test_the_shape_has_the_colour_its_answer_names(tmp_path, answer):
    from PIL import Image

    for seed in range(4):
        synthetic.colour_image(tmp_path / "c.png", synthetic.COLOURS[answer - 1], seed=seed)
        pixels = np.asarray(Image.open(tmp_path / "c.png").convert("RGB")).reshape(-1, 3).astype(int)
        shape = pixels[pixels.max(1) - pixels.min(1) > 60]  # saturated pixels: the shape, not the grey ground
        assert len(shape) > 0.3 * len(pixels)  # large: most of the image
        assert np.bincount(shape.argmax(1), minlength=3).argmax() == answer - 1


@pytest.mark.parametrize("answer", [1, 2, 3])
def test_the_tone_lies_in_the_band_its_answer_names(tmp_path, answer):
    import soundfile as sf

    low, high = synthetic.PITCHES_HZ[answer - 1]
    synthetic.tone(tmp_path / "t.wav", (low + high) / 2, seconds=0.5)
    wave, rate = sf.read(tmp_path / "t.wav")
    assert rate == 16000 and len(wave) == 8000
    peak = np.fft.rfftfreq(len(wave), 1 / rate)[np.abs(np.fft.rfft(wave)).argmax()]
    assert low <= peak <= high


def test_the_video_fades_the_way_its_answer_names(tmp_path):
    import av

    levels = {}
    for lighter in (False, True):
        synthetic.fading_video(tmp_path / "f.mp4", lighter=lighter)
        with av.open(str(tmp_path / "f.mp4")) as video:
            levels[lighter] = [frame.to_ndarray(format="gray").mean() for frame in video.decode(video=0)]
    assert len(levels[True]) == 8 and np.all(np.diff(levels[True]) > 0) and np.all(np.diff(levels[False]) < 0)
    assert abs(np.mean(levels[True]) - np.mean(levels[False])) < 2  # the same mean: only the order differs


def test_rows_name_their_task_and_media_where_asked(tmp_path):
    path = synthetic.make_dataset(tmp_path / "d", ("colour", "pitch", "fade"), rows=6, media_dir="/elsewhere")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, task in zip(rows, ("colour", "pitch", "fade") * 2, strict=True):
        media, text = row["prompt"][0]["content"]
        assert media["type"] == synthetic.KIND[task] and text["text"] == synthetic.QUESTIONS[task]
        name = media[media["type"]]
        assert (
            name.startswith("/elsewhere/") and (tmp_path / "d" / name.removeprefix("/elsewhere/")).is_file()
        )
        assert 1 <= int(row["label"]) <= (2 if task == "fade" else 3)


def test_the_loader_tasks_are_unchanged(tmp_path):
    """Media kinds keep their original tasks and draws (other tests and the bench rely on them)."""
    path = synthetic.make_dataset(tmp_path, ("image", "audio", "video"), rows=3, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rng = random.Random(0)
    assert rows[0]["label"] == str(rng.randint(1, 4))
    assert [r["prompt"][0]["content"][1]["text"] for r in rows] == [
        synthetic.QUESTIONS[k] for k in ("image", "audio", "video")
    ]
    assert [r["prompt"][0]["content"][0] for r in rows] == [
        {"type": "image", "image": "image_0.png"},
        {"type": "audio", "audio": "audio_1.wav"},
        {"type": "video", "video": "video_2.mp4"},
    ]
