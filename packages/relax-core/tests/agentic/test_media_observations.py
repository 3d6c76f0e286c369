"""A tool returns an image: the next turn's prompt carries it through the processor (tiny Qwen2.5-VL),
and the trainer's logprobs on the sampled tokens still equal the engine's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relax.core.agentic import EpisodeLimits, NoToolCalls, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.multimodal_model import media_token_ids
from relax.core.protocols import SamplingParams, StepResult
from relax.core.testing.multimodal_processor import TinyMediaProcessor
from relax.core.testing.trainer import torch_trainer
from relax.omni.tiny_models import tiny_multimodal_dir


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image

    root, rng = tmp_path_factory.mktemp("images"), np.random.default_rng(0)
    paths = []
    for name, shape in (("prompt.png", (56, 56, 3)), ("tool.png", (28, 84, 3))):
        Image.fromarray((rng.random(shape) * 255).astype("uint8")).save(root / name)
        paths.append(str(root / name))
    return paths


class ImageTool:
    """Turn 0 gets a tool observation with an image (or a broken file); turn 1 ends the episode."""

    def __init__(self, image):
        self.image = image

    def start(self, sample):
        image = self.image

        class Episode:
            def step(self, turn):
                if turn.index == 0:
                    return StepResult(
                        [
                            {
                                "role": "tool",
                                "content": [
                                    {"type": "image", "image": image},
                                    {"type": "text", "text": "the plot"},
                                ],
                            }
                        ]
                    )
                return StepResult(done=True, reward=1.0)

            def close(self):
                pass

        return Episode()


def _run(model_dir, processor, prompts, image):
    tokenizer = processor.hf.tokenizer
    from transformers import AutoConfig

    media_ids = media_token_ids(AutoConfig.from_pretrained(model_dir))
    turns = Turns(
        ImageTool(image),
        NoToolCalls(),
        tokenizer,
        EpisodeLimits(max_turns=3, max_total_tokens=2048, max_observation_tokens=1024, turn_timeout_s=30),
        stop_token_ids(tokenizer),
        processor,
        media_ids,
    )
    engine = HFRolloutEngine(model_dir)

    class Sync:  # the engine as the driver calls a role
        def generate(self, requests):
            return asyncio.run(engine.generate(requests))

    groups = [
        [
            Sample(prompt_ids=list(p["prompt_ids"]), group_id=g, index_in_group=i, mm_inputs=p["inputs"])
            for i in range(2)
        ]
        for g, p in enumerate(prompts)
    ]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    list(
        stream_groups(
            EngineRouter([LocalHandle(Sync())]), groups, params, seed=5, step=1, timeout_s=120, turns=turns
        )
    )
    return [s for g in groups for s in g], media_ids


def test_a_tools_image_joins_the_trajectory_and_training_matches_rollout(images, tmp_path_factory):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    processor = TinyMediaProcessor(model_dir)
    with_image = processor.process(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "what?"}],
            }
        ],
        [],
        "row 1",
    )
    text_only = processor.process([{"role": "user", "content": "what?"}], [], "row 2")
    samples, media_ids = _run(model_dir, processor, [with_image, text_only], images[1])
    image_pad = processor.hf.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for s in samples:
        assert s.metadata["episode"]["turns"] == 2 and s.metadata.get("episode_error") is None
        grids = s.mm_inputs["image_grid_thw"]
        assert grids.shape[0] == (2 if s.group_id == 0 else 1)  # the prompt's image (if any), then the tool's
        tool_pads = int(grids[-1].prod()) // 4  # one placeholder per 2x2 merged patch
        observed = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0]
        assert observed.count(image_pad) == tool_pads > 0  # the observation carries the expanded image
        sampled = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 1]
        assert len(sampled) >= 2
    batch = collate(samples, pad_id=processor.hf.tokenizer.pad_token_id)
    assert batch["observation_mask"].sum() > 0
    trained = torch_trainer(model_dir, micro_batch_size=2).forward_logprobs(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(trained[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)


def test_a_broken_image_ends_the_episode_with_the_reason(images, tmp_path_factory, tmp_path):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    processor = TinyMediaProcessor(model_dir)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    prompt = processor.process([{"role": "user", "content": "what?"}], [], "row 1")
    samples, _ = _run(model_dir, processor, [prompt], str(broken))
    for s in samples:  # the episode ends after its first turn, counted, with the media error named
        assert s.metadata["episode"]["errors"] == 1 and s.metadata["episode"]["turns"] == 1
        assert "undecodable image" in s.metadata["episode_error"] and s.mm_inputs is prompt["inputs"]
