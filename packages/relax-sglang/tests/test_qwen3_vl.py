"""Qwen3-VL through SGLang over HTTP on CPU (one server launch for the module, the tiny Qwen3-VL): images and
videos processed by relax-omni give the HF engine's greedy tokens and its logprobs.

Qwen3-VL writes each temporal grid's time into the prompt ("<1.5 seconds>"). The engine collapses every video
block back to the template's placeholder, sends the sampled frames in a container tagged with those times,
and Relax's server patch gives them to SGLang's processor (SGLang would re-derive other times: "<1.2
seconds>" for the 2-grid clip below) and keeps the frames' size (SGLang would resample them to a multiple of
28: a 5e-3 logprob gap)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_vl(sglang_python, tmp_path_factory):
    """(engine, model dir, relax-omni processor for it)."""
    from transformers import AutoProcessor

    from relax.core.testing.multimodal_models import tiny_multimodal_dir
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.testing import engine_params

    root = tmp_path_factory.getbasetemp()
    model_dir = tiny_multimodal_dir(root, "qwen3_vl")
    proc = QwenOmniProcessor(AutoProcessor.from_pretrained(model_dir), FAMILIES["qwen3_vl"], OmniProcessorParams(max_frames=64))
    engine = SGLangEngine(engine_params(), model_dir, run_dir=str(root / "sglang-qwen3-vl-run"))
    yield engine, model_dir, proc
    engine.close()


def test_images_and_timestamped_videos_equal_the_hf_engine(qwen3_vl, tmp_path):
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.testing.multimodal import write_media
    from relax.omni import synthetic

    engine, model_dir, proc = qwen3_vl
    for name, frames in (("one_grid", 4), ("two_grids", 8)):  # 1 s / 2 s at 4 fps, sampled at 2 fps
        synthetic.moving_dot_video(tmp_path / f"{name}.mp4", right=name == "one_grid", frames=frames)
    image = write_media(tmp_path)["image"]
    rows = {
        "image": [{"type": "image", "image": image}, {"type": "text", "text": "what?"}],
        "video": [{"type": "video", "video": str(tmp_path / "two_grids.mp4")}, {"type": "text", "text": "where?"}],
        "two videos and an image": [{"type": "video", "video": str(tmp_path / "one_grid.mp4")},
                                    {"type": "image", "image": image}, {"type": "text", "text": "and"},
                                    {"type": "video", "video": str(tmp_path / "two_grids.mp4")}],
    }
    requests = []
    for name, content in rows.items():
        p = proc.process([{"role": "user", "content": content}], [], f"t.jsonl:{name}")
        requests.append(GenerationRequest(name, list(p["prompt_ids"]), GREEDY, media=p["inputs"]))
    assert "<1.5 seconds>" in proc.tokenizer.decode(requests[1].prompt_ids)  # SGLang alone would write 1.2
    results = asyncio.run(asyncio.wait_for(engine.generate(requests), 300))
    hf = HFRolloutEngine(model_dir)
    wants = asyncio.run(asyncio.wait_for(hf.generate(requests), 300))
    gaps = {}
    for req, got, want in zip(requests, results, wants, strict=True):
        assert got.response_ids == want.response_ids, f"{req.request_id}: SGLang {got.response_ids} vs HF {want.response_ids}"
        gaps[req.request_id] = (torch.tensor(got.logprobs) - torch.tensor(want.logprobs)).abs().max().item()
    print(f"SGLang vs HF engine logprob gaps: {gaps}")
    assert max(gaps.values()) < 1e-4, gaps  # measured 9e-6
