"""``MultimodalProcessorConformance``: what core relies on from a ``MultimodalProcessor``.

``process(messages, media, where)`` returns a ``ProcessedPrompt`` whose ids hold one placeholder token per
media embedding the model will insert, whose inputs are the model's media kwargs for this one prompt (no
``input_ids`` / ``attention_mask``), deterministically; bad media raise ``MediaError`` naming ``where`` and
the item. Runs on the tiny families of ``relax.omni.tiny_models`` (built locally, no hub).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relax.core.processors import MediaError, MultimodalProcessor


def write_media(root: Path) -> dict[str, str]:
    """A 60x80 PNG with a drawn circle and a 0.5 s 16 kHz tone (WAV and ``.npy``) under ``root``."""
    import wave

    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (80, 60), "white")
    ImageDraw.Draw(img).ellipse((20, 15, 50, 45), fill="red")
    img.save(root / "circle.png")
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)).astype(np.float32)
    np.save(root / "tone.npy", tone)
    with wave.open(str(root / "tone.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((tone * 32767).astype("<i2").tobytes())
    return {
        "image": str(root / "circle.png"),
        "audio_npy": str(root / "tone.npy"),
        "audio": str(root / "tone.wav"),
    }


class MultimodalProcessorConformance:
    """Subclass as ``class TestMine(MultimodalProcessorConformance)``; implement ``media_model(root)`` (the
    directory of a tiny checkpoint of your family with its processor files, built under ``root``) and
    ``make_processor(model_dir)``. Set ``audio = True`` for a processor that takes audio; override
    ``audio_ref`` if it reads another audio format."""

    audio = False  # the messages also carry an audio item, and its features are checked

    def media_model(self, root: Path) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement media_model(self, root)")

    def make_processor(self, model_dir: str) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement make_processor(self, model_dir)")

    def audio_ref(self, media: dict[str, str]) -> str:
        return media["audio"]

    @pytest.fixture(scope="class")
    @classmethod
    def mm_setup(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, dict[str, str]]:
        """(processor, model config, media paths), once per class."""
        from transformers import AutoConfig

        model_dir = cls().media_model(tmp_path_factory.getbasetemp())
        media = write_media(tmp_path_factory.mktemp("conformance_media"))
        return cls().make_processor(model_dir), AutoConfig.from_pretrained(model_dir), media

    def messages(self, media: dict[str, str]) -> list[dict[str, Any]]:
        content = [{"type": "image", "image": media["image"]}]
        if self.audio:
            content.append({"type": "audio", "audio": self.audio_ref(media)})
        return [{"role": "user", "content": [*content, {"type": "text", "text": "how many circles?"}]}]

    def test_is_a_multimodal_processor(self, mm_setup):
        processor, _, _ = mm_setup
        assert isinstance(processor, MultimodalProcessor) and processor.multimodal is True

    def test_ids_hold_one_placeholder_per_embedding(self, mm_setup):
        processor, config, media = mm_setup
        out = processor.process(self.messages(media), [], "rows.jsonl:1")
        assert set(out) >= {"prompt_text", "prompt_ids", "inputs", "counts"}
        assert not {"input_ids", "attention_mask"} & set(out["inputs"])
        ids = torch.tensor(out["prompt_ids"])
        image_id = getattr(config, "image_token_id", None) or config.image_token_index
        merge = config.vision_config.spatial_merge_size**2
        assert int((ids == image_id).sum()) == int(out["inputs"]["image_grid_thw"].prod(-1).sum()) // merge
        assert out["counts"].get("image") == 1
        if self.audio:
            assert out["counts"].get("audio") == 1 and "input_features" in out["inputs"]

    def test_deterministic(self, mm_setup):
        processor, _, media = mm_setup
        a, b = (processor.process(self.messages(media), [], "rows.jsonl:1") for _ in range(2))
        assert a["prompt_ids"] == b["prompt_ids"] and a["inputs"].keys() == b["inputs"].keys()
        assert all(torch.equal(a["inputs"][k], b["inputs"][k]) for k in a["inputs"])

    def test_missing_file_names_row_and_item(self, mm_setup):
        processor, _, media = mm_setup
        messages = self.messages(media)
        messages[0]["content"][0]["image"] = str(Path(media["image"]).with_name("absent.png"))
        with pytest.raises(MediaError) as err:
            processor.process(messages, [], "rows.jsonl:7")
        assert err.value.where == "rows.jsonl:7" and "absent.png" in err.value.item
