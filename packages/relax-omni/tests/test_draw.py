"""Draw-time processing: a multimodal dataset keeps messages + media refs; each drawn prompt is processed
once and its inputs shared by the whole group; bad media raise naming row + item, or are skipped and counted
(another prompt is drawn, the rest of the batch is kept). Core's machinery (``relax.core.data_multimodal``,
core's ``TinyMediaProcessor``) on relax-omni's tiny Qwen2.5-VL, the family that gives it media tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from relax.core.controller.prompts import PromptSource
from relax.core.data import collate
from relax.core.data_multimodal import draw_multimodal, resolve
from relax.core.dataset import DatasetConfig, PromptDataset
from relax.core.processors import MediaError
from relax.core.testing.multimodal_processor import TinyMediaProcessor
from relax.omni.tiny_models import tiny_multimodal_dir

G = 4


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("draw")
    rng = np.random.default_rng(1)
    for name in ("a", "b", "c"):
        Image.fromarray((rng.random((56, 56, 3)) * 255).astype("uint8")).save(root / f"{name}.png")
    (root / "truncated.png").write_bytes((root / "a.png").read_bytes()[:40])

    def row(image, text):
        return {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(root / image)},
                        {"type": "text", "text": text},
                    ],
                }
            ],
            "label": "1",
        }

    rows = [
        row("a.png", "one?"),
        row("truncated.png", "two?"),
        row("b.png", "three?"),
        {"messages": "four?", "label": "1", "picture": str(root / "c.png")},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")


def source(path, model_dir, on_error, max_prompt_length=None):
    processor = TinyMediaProcessor(model_dir)
    cfg = DatasetConfig(
        path=str(path),
        prompt_key="messages",
        label_key="label",
        media_keys=("picture",),
        batch_size=2,
        shuffle=False,
        on_error=on_error,
        max_prompt_length=max_prompt_length,
    )
    dataset = PromptDataset(cfg, processor.hf.tokenizer, processor)
    return PromptSource(dataset, SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=G))), processor


def test_bad_media_raise_names_row_and_item(data_file, model_dir):
    prompts, processor = source(data_file, model_dir, "raise")
    assert prompts.dataset.multimodal and processor.calls == 0  # nothing is loaded at dataset construction
    assert prompts.dataset.items[0].messages[0]["content"][0]["type"] == "image"
    with pytest.raises(MediaError) as err:
        prompts.draw(0)
    assert err.value.where == "rows.jsonl:2"
    assert "messages[0].content[0] image" in err.value.item and "truncated.png" in err.value.item
    assert "undecodable image" in err.value.why


def test_group_shares_one_processing_and_bad_media_is_skipped(data_file, model_dir):
    prompts, processor = source(data_file, model_dir, "skip")
    groups = prompts.draw(0)
    assert (
        [g[0].metadata for g in groups] == [{}, {}] and len(groups) == 2 and all(len(g) == G for g in groups)
    )
    stats = prompts.dataset.stats
    assert stats["skipped_media"] == 1 and stats["processed_prompts"] == 2 and stats["media_image"] == 2
    assert processor.calls == 3  # two kept prompts + the skipped one: once per prompt, never per sample
    for g in groups:
        assert all(s.mm_inputs is g[0].mm_inputs for s in g)  # one shared object for the group
        assert all(s.prompt_ids == g[0].prompt_ids for s in g)
    assert groups[0][0].prompt_text.endswith("one?<|im_end|>\n<|im_start|>assistant\n")
    assert groups[1][0].prompt_text.endswith(
        "three?<|im_end|>\n<|im_start|>assistant\n"
    )  # row 3 replaced row 2
    column_row = prompts.dataset.items[3]  # media in a column: the image joins the first user message
    assert column_row.media == [{"key": "picture", "ref": str(data_file.parent / "c.png")}]
    (ready,), (shared,) = draw_multimodal(prompts.dataset, [column_row])
    inputs = resolve(shared)  # an ObjectRef once Ray is up (a whole suite run), the dict itself otherwise
    assert (
        ready.prompt_text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
        and "four?" in ready.prompt_text
    )
    assert inputs["image_grid_thw"].shape == (1, 3)
    batch = collate([s for g in groups for s in g], pad_id=0)
    assert (
        batch["mm.pixel_values"].shape[0] == 2 * G
        and batch["mm.image_grid_thw.shape"][:, 0].tolist() == [1] * 8
    )


def test_every_row_bad_fails_instead_of_drawing_forever(tmp_path, model_dir):
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": str(tmp_path / f"gone{i}.png")}]}
            ],
            "label": "1",
        }
        for i in range(2)
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, processor = source(path, model_dir, "skip")
    with pytest.raises(MediaError, match="bad media in too many rows in a row"):
        prompts.draw(0)
    assert prompts.dataset.stats["skipped_media"] == 200 and processor.calls == 200


def test_prompt_too_long_with_its_media_is_dropped_counted_and_replaced(tmp_path, model_dir):
    """``data.max_prompt_length`` holds for the expanded media placeholders too: the row is dropped and counted
    (``filtered_too_long``, like a long text row at load) and the next prompt drawn; nothing is truncated."""
    from PIL import Image

    for name, side in (("small", 56), ("big", 112)):
        Image.new("RGB", (side, side), "white").save(tmp_path / f"{name}.png")
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(tmp_path / f"{name}.png")},
                        {"type": "text", "text": f"{i}?"},
                    ],
                }
            ],
            "label": "1",
        }
        for i, name in enumerate(("small", "big", "small"))
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(TinyMediaProcessor(model_dir).process(r["messages"], [], "x")["prompt_ids"]) for r in rows]
    assert lengths[0] == lengths[2] < lengths[1]  # 4 vs 16 image tokens
    prompts, _ = source(path, model_dir, "raise", max_prompt_length=lengths[0])
    groups = prompts.draw(0)
    assert [g[0].prompt_text.split("<|vision_end|>")[1][0] for g in groups] == ["0", "2"]  # row 2 replaced
    assert all(len(g[0].prompt_ids) == lengths[0] for g in groups)  # kept whole, not truncated
    assert prompts.dataset.stats["filtered_too_long"] == 1 and prompts.dataset.stats["processed_prompts"] == 2
    too_short, _ = source(path, model_dir, "skip", max_prompt_length=lengths[0] - 1)
    with pytest.raises(
        MediaError, match=rf"prompts longer than data.max_prompt_length={lengths[0] - 1} in too many"
    ):
        too_short.draw(0)
    assert too_short.dataset.stats["filtered_too_long"] == 200
