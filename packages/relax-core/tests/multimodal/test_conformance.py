"""Core's minimal test processor passes the multimodal processor conformance kit (VL and Omni)."""

from __future__ import annotations

from relax.core.testing.multimodal import MultimodalProcessorConformance
from relax.core.testing.multimodal_processor import TinyMediaProcessor


class TestTinyMediaProcessorVL(MultimodalProcessorConformance):
    family = "qwen2_5_vl"

    def make_processor(self, model_dir):
        return TinyMediaProcessor(model_dir)


class TestTinyMediaProcessorOmni(TestTinyMediaProcessorVL):
    family = "qwen3_omni"

    def audio_ref(self, media):
        return media["audio_npy"]
