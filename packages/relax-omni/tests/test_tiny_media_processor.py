"""Core's minimal test processor passes core's multimodal processor conformance kit on relax-omni's tiny
Qwen2.5-VL and Qwen3-Omni checkpoints (the kit names no family: the subclass builds the model)."""

from __future__ import annotations

from relax.core.testing.multimodal import MultimodalProcessorConformance
from relax.core.testing.multimodal_processor import TinyMediaProcessor
from relax.omni.tiny_models import tiny_multimodal_dir


class TestTinyMediaProcessorVL(MultimodalProcessorConformance):
    family = "qwen2_5_vl"

    def media_model(self, root):
        return tiny_multimodal_dir(root, self.family)

    def make_processor(self, model_dir):
        return TinyMediaProcessor(model_dir)


class TestTinyMediaProcessorOmni(TestTinyMediaProcessorVL):
    family, audio = "qwen3_omni", True

    def audio_ref(self, media):
        return media["audio_npy"]
