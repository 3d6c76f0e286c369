"""Shared fixtures for relax-omni tests: generated media files (good and bad) and the tiny VL/Omni models."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def media(tmp_path_factory):
    """Small media files: good ones from ``relax.omni.synthetic`` and a bad-media corpus next to them."""
    from relax.omni import synthetic

    d = tmp_path_factory.mktemp("media")
    synthetic.circles_image(d / "circles.png", 3)
    synthetic.two_tones(d / "tones.wav", 440.0, 220.0, seconds=0.25)
    synthetic.moving_dot_video(d / "dot.mp4", right=True)
    synthetic.moving_dot_video(d / "dot_sound.mp4", right=False, tone_hz=330.0)
    png = (d / "circles.png").read_bytes()
    (d / "truncated.png").write_bytes(png[: len(png) // 2])
    (d / "tones_as.png").write_bytes((d / "tones.wav").read_bytes())
    (d / "noise.wav").write_bytes(bytes(range(256)) * 8)
    (d / "noise.mp4").write_bytes(bytes(range(256)) * 8)
    return d


@pytest.fixture(scope="session")
def assert_source_audio():
    """Check a processed prompt's ``source.audio.<i>`` waveforms: ``n`` of them, and the HF feature extractor
    (with the processor's own audio kwargs) turns them into exactly the prompt's ``input_features``."""
    import torch

    from relax.core.data_multimodal import source_media

    def check(proc, inputs: dict, n: int) -> None:
        waves = source_media(inputs, "audio")
        assert len(waves) == n and all(w.dtype == torch.float32 and w.dim() == 1 for w in waves)
        kwargs = {**type(proc.hf).audio_kwargs, "return_tensors": "pt"}
        again = proc.hf.feature_extractor([w.numpy() for w in waves], **kwargs)
        assert torch.equal(again["input_features"], inputs["input_features"])
        assert torch.equal(again["attention_mask"], inputs["feature_attention_mask"])

    return check
