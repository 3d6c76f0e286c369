"""Media loading: every accepted reference form, the budgets, and the bad-media corpus with its exact errors."""

from __future__ import annotations

import base64
import shutil

import pytest

from relax.core.processors import MediaError
from relax.omni.media import MediaBudget, load_media, short_ref

BUDGET = MediaBudget(
    min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=28 * 28, video_max_pixels=56 * 56, max_frames=4
)


def row(*items, text="how many circles?"):
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def data_url(path, mime):
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def test_local_path_file_url_and_data_url_load_the_same_pixels(media):
    import numpy as np

    path = media / "circles.png"
    refs = [str(path), f"file://{path}", data_url(path, "image/png"), "circles.png"]
    budget = MediaBudget(**{**BUDGET.__dict__, "media_root": str(media)})
    images = [load_media(row({"type": "image", "image": r}), [], budget, "t:1").images[0] for r in refs]
    assert all(np.array_equal(np.asarray(images[0]), np.asarray(im)) for im in images[1:])
    assert images[0].size == (112, 84)  # 112x84 is within the budget and a multiple of 28


def test_budgets_reach_qwen_omni_utils(media):
    small = MediaBudget(**{**BUDGET.__dict__, "max_pixels": 56 * 56, "max_frames": 2})
    loaded = load_media(
        row(
            {"type": "image", "image": str(media / "circles.png")},
            {"type": "video", "video": str(media / "dot.mp4")},
            {"type": "audio", "audio": str(media / "tones.wav")},
        ),
        [],
        small,
        "t:1",
    )
    assert loaded.counts == {"image": 1, "video": 1, "audio": 1}
    assert loaded.images[0].size[0] * loaded.images[0].size[1] <= 56 * 56
    assert loaded.videos[0].shape[0] == 2  # max_frames
    assert loaded.audios[0].shape == (8000,)  # two 0.25 s tones at 16 kHz
    assert loaded.messages[0]["content"] == [
        {"type": "image"},
        {"type": "video"},
        {"type": "audio"},
        {"type": "text", "text": "how many circles?"},
    ]


def test_column_media_attach_to_the_first_user_message(media):
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "how many circles?"}]
    refs = [
        {"key": "image", "ref": str(media / "circles.png")},
        {"key": "clip", "ref": {"audio": str(media / "tones.wav")}},
    ]
    loaded = load_media(messages, refs, BUDGET, "t:1")
    assert loaded.counts == {"image": 1, "video": 0, "audio": 1}
    assert loaded.messages[1]["content"][:2] == [{"type": "image"}, {"type": "audio"}]
    assert loaded.messages[0] == messages[0]


@pytest.mark.skipif(
    shutil.which("ffmpeg") is None, reason="use_audio_in_video needs ffmpeg (scripts/install.sh)"
)
def test_audio_in_video(media):
    budget = MediaBudget(**{**BUDGET.__dict__, "use_audio_in_video": True})
    loaded = load_media(row({"type": "video", "video": str(media / "dot_sound.mp4")}), [], budget, "t:3")
    assert loaded.counts == {"image": 0, "video": 1, "audio": 1}
    assert 1.9 < loaded.audios[0].shape[0] / 16000 < 2.3  # the 2 s soundtrack (AAC pads a little)
    with pytest.raises(MediaError) as e:
        load_media(row({"type": "video", "video": str(media / "dot.mp4")}), [], budget, "t:4")
    assert e.value.why == "the video has no audio track (use_audio_in_video is on)"


def corpus(m):
    """(content item or column ref, budget overrides, allowed kinds, expected item, expected why)."""
    wav = data_url(m / "tones.wav", "audio/wav")
    return [
        (
            {"type": "image", "image": str(m / "gone.png")},
            {},
            None,
            None,
            f"file not found: {m / 'gone.png'}",
        ),
        ({"type": "image", "image": str(m / "truncated.png")}, {}, None, None, "truncated image"),
        ({"type": "image", "image": str(m / "tones_as.png")}, {}, None, None, "not a decodable image"),
        ({"type": "audio", "audio": str(m / "noise.wav")}, {}, None, None, "undecodable audio"),
        ({"type": "video", "video": str(m / "noise.mp4")}, {}, None, None, "undecodable video"),
        (
            {"type": "image", "image": 7},
            {},
            None,
            None,
            "wrong type: expected a path, file:// URL or base64 data URL string, got int",
        ),
        (
            {"type": "image", "image": wav},
            {},
            None,
            None,
            "wrong type: a data URL of type audio/wav where image is expected",
        ),
        (
            {"type": "audio", "audio": str(m / "tones.wav")},
            {},
            ("image", "video"),
            None,
            "wrong type: this model takes image, video, not audio",
        ),
        (
            {"type": "pdf", "pdf": "a.pdf"},
            {},
            None,
            "messages[0].content[0]",
            "unsupported content type 'pdf' (expected text, image, video or audio)",
        ),
        (
            {"type": "image", "image": str(m / "circles.png")},
            {"max_bytes_per_item": 100},
            None,
            None,
            f"over budget: {(m / 'circles.png').stat().st_size} bytes > max_bytes_per_item=100",
        ),
        (
            {"type": "audio", "audio": str(m / "tones.wav")},
            {"max_audio_seconds": 0.2},
            None,
            None,
            "over budget: 0.5 s of audio > max_audio_seconds=0.2",
        ),
        (
            {"type": "image", "image": "https://example.com/cat.png"},
            {},
            None,
            None,
            "remote URLs are not loaded (runs read no network); download the file and use its path",
        ),
        (
            {"type": "image", "image": "data:image/png;base64,%%%%"},
            {},
            None,
            None,
            "invalid base64 in data URL",
        ),
    ]


def test_bad_media_corpus_names_row_item_and_reason(media):
    for i, (item, overrides, allowed, want_item, want_why) in enumerate(corpus(media)):
        budget = MediaBudget(**{**BUDGET.__dict__, **overrides})
        kwargs = {"allowed": allowed} if allowed else {}
        good = {"type": "image", "image": str(media / "circles.png")}
        with pytest.raises(MediaError) as e:
            load_media(row(item, good), [], budget, f"bad.jsonl:{i}", **kwargs)
        kind = item["type"]
        ref = short_ref(item[kind])
        assert e.value.where == f"bad.jsonl:{i}"
        assert e.value.item == (want_item or f"messages[0].content[0] {kind} {ref}")
        assert e.value.why == want_why, (i, e.value.why)
        assert str(e.value) == f"bad.jsonl:{i}: {e.value.item}: {want_why}"


def test_bad_column_media_names_the_column(media):
    refs = [{"key": "image", "ref": str(media / "truncated.png")}]
    with pytest.raises(MediaError) as e:
        load_media([{"role": "user", "content": "how many circles?"}], refs, BUDGET, "train.jsonl:9")
    assert str(e.value) == (
        f"train.jsonl:9: media[0] (column 'image') image {short_ref(media / 'truncated.png')}: "
        "truncated image"
    )
    with pytest.raises(MediaError, match="cannot tell the media kind of column 'blob'"):
        load_media([{"role": "user", "content": "x"}], [{"key": "blob", "ref": "x.bin"}], BUDGET, "t:2")


def test_budget_validation_names_the_fields():
    errors = MediaBudget(min_pixels=10, max_pixels=5, fps=0, max_frames=1, max_audio_seconds=-1).validate()
    assert errors == [
        "min_pixels (10) must be <= max_pixels (5)",
        "fps must be > 0, got 0",
        "max_frames must be >= 2 (Qwen groups frames in pairs), got 1",
        "max_audio_seconds must be > 0, got -1",
    ]


def test_video_from_a_data_url_equals_the_file(media):
    import torch

    path = media / "dot.mp4"
    frames = [
        load_media(row({"type": "video", "video": ref}), [], BUDGET, "t:1").videos[0]
        for ref in (str(path), data_url(path, "video/mp4"))
    ]
    assert frames[0].shape[0] == 4 and torch.equal(frames[0], frames[1])
