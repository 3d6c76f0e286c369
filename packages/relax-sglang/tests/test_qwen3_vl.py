"""Qwen3-VL through SGLang over HTTP on CPU (one server launch for the module, the tiny Qwen3-VL): images and
videos processed by relax-omni give the HF engine's greedy tokens and its logprobs.

Qwen3-VL writes each temporal grid's time into the prompt ("<1.5 seconds>"). The engine collapses every video
block back to the template's placeholder, sends the sampled frames in a container tagged with those times,
and Relax's server patch gives them to SGLang's processor (SGLang would re-derive other times: "<1.2
seconds>" for the 2-grid clip below) and keeps the frames' size (SGLang would resample them to a multiple of
28: a 5e-3 logprob gap).

The megatron trainer's weights (LM and vision tower, HF-named as core's torch trainer exports them) go into
the same server through each ``sglang_*`` transport and serve the HF engine's tokens on these prompts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_vl(sglang_python, tmp_path_factory):
    """(engine, model dir, relax-omni processor for it)."""
    from transformers import AutoProcessor

    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor
    from relax.omni.tiny_models import tiny_multimodal_dir
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.testing import engine_params

    root = tmp_path_factory.getbasetemp()
    model_dir = tiny_multimodal_dir(root, "qwen3_vl")
    proc = QwenOmniProcessor(
        AutoProcessor.from_pretrained(model_dir), FAMILIES["qwen3_vl"], OmniProcessorParams(max_frames=64)
    )
    engine = SGLangEngine(engine_params(), model_dir, run_dir=str(root / "sglang-qwen3-vl-run"))
    yield engine, model_dir, proc
    engine.close()


@pytest.fixture(scope="module")
def prompts(qwen3_vl, tmp_path_factory) -> list[GenerationRequest]:
    """Greedy requests on an image, a 2-grid video, and two videos with an image between them."""
    from relax.core.testing.multimodal import write_media
    from relax.omni import synthetic

    _, _, proc = qwen3_vl
    root = tmp_path_factory.mktemp("qwen3-vl-media")
    for name, frames in (("one_grid", 4), ("two_grids", 8)):  # 1 s / 2 s at 4 fps, sampled at 2 fps
        synthetic.moving_dot_video(root / f"{name}.mp4", right=name == "one_grid", frames=frames)
    image = write_media(root)["image"]
    rows = {
        "image": [{"type": "image", "image": image}, {"type": "text", "text": "what?"}],
        "video": [
            {"type": "video", "video": str(root / "two_grids.mp4")},
            {"type": "text", "text": "where?"},
        ],
        "two videos and an image": [
            {"type": "video", "video": str(root / "one_grid.mp4")},
            {"type": "image", "image": image},
            {"type": "text", "text": "and"},
            {"type": "video", "video": str(root / "two_grids.mp4")},
        ],
    }
    out = []
    for name, content in rows.items():
        p = proc.process([{"role": "user", "content": content}], [], f"t.jsonl:{name}")
        out.append(GenerationRequest(name, list(p["prompt_ids"]), GREEDY, media=p["inputs"]))
    return out


@pytest.fixture(scope="module")
def hf_reference(qwen3_vl, prompts):
    """(core's HF engine on the model, its greedy results on ``prompts`` with the original weights)."""
    from relax.core.engines.hf import HFRolloutEngine

    hf = HFRolloutEngine(qwen3_vl[1])
    return hf, _generate(hf, prompts)


def _generate(engine, requests: list[GenerationRequest]) -> list:
    return asyncio.run(asyncio.wait_for(engine.generate(requests), 300))


def _gaps(got: list, want: list, requests: list[GenerationRequest]) -> dict[str, float]:
    """request id -> max |logprob gap|; the greedy tokens must be equal."""
    gaps = {}
    for req, g, w in zip(requests, got, want, strict=True):
        assert g.response_ids == w.response_ids, (
            f"{req.request_id}: SGLang {g.response_ids} vs HF {w.response_ids}"
        )
        gaps[req.request_id] = (torch.tensor(g.logprobs) - torch.tensor(w.logprobs)).abs().max().item()
    return gaps


def _moved(a: list, b: list) -> float:
    """The largest per-token logprob change between two runs of the same requests (inf: other tokens)."""
    if [r.response_ids for r in a] != [r.response_ids for r in b]:
        return float("inf")
    return max(
        abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra.logprobs, rb.logprobs, strict=True)
    )


def test_images_and_timestamped_videos_equal_the_hf_engine(qwen3_vl, prompts, hf_reference):
    engine, _, proc = qwen3_vl
    assert "<1.5 seconds>" in proc.tokenizer.decode(prompts[1].prompt_ids)  # SGLang alone would write 1.2
    gaps = _gaps(_generate(engine, prompts), hf_reference[1], prompts)
    print(f"SGLang vs HF engine logprob gaps: {gaps}")
    assert max(gaps.values()) < 1e-4, gaps  # measured 9e-6


@pytest.fixture(scope="module")
def sync_prompts(qwen3_vl, prompts) -> list[GenerationRequest]:
    """``prompts`` stopping at a generated media placeholder or vision start/end token (the tiny vocabulary's
    trained model samples them): a placeholder with no media behind it is a case the engines need not agree
    on (measured: the HF engine and a server launched on the same weights part there, 0.6 logprob)."""
    from dataclasses import replace

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(qwen3_vl[1])
    ids = tuple(getattr(config, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end"))
    return [replace(r, params=replace(r.params, stop_token_ids=ids)) for r in prompts]


@pytest.fixture(scope="module")
def megatron_vl(megatron_world, qwen3_vl, prompts, sync_prompts, hf_reference):
    """(the megatron trainer after one policy-gradient step on the prompts (towers trainable), the HF
    engine's greedy results on ``sync_prompts`` with its exported weights)."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.data import Sample, collate
    from relax.core.testing.models import load_hf_weights
    from relax.core.testing.trainer import exported
    from relax.megatron.trainer import MegatronTrainer

    _, model_dir, proc = qwen3_vl
    hf = hf_reference[0]
    answer = proc.tokenizer.encode("a dot moves to the left")
    samples = [
        Sample(prompt_ids=r.prompt_ids, group_id=i, response_ids=answer[i : i + 3], mm_inputs=r.media)
        for i, r in enumerate(prompts)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.tensor([1.0, -0.5, 1.0])[:, None] * batch["response_mask"]
    trainer = MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, micro_batch_size=3
    )
    trainer.train_step({**batch, "old_logprobs": trainer.forward_logprobs(batch)})
    weights, original = exported(trainer), load_hf_weights(model_dir)
    tower = [n for n in weights if n.startswith("model.visual.")]
    assert tower and max(float((weights[n] - original[n]).abs().max()) for n in tower) > 1e-3, (
        "the tower did not train"
    )
    # the towers' share of the change alone moves the outputs: a sync that dropped them would fail below
    hf.update_weights({n: t for n, t in weights.items() if n not in tower}, 1)
    lm_only = _generate(hf, sync_prompts)
    hf.update_weights(weights, 1)
    want = _generate(hf, sync_prompts)
    assert sum(len(r.response_ids) for r in want) >= 6, [
        r.response_ids for r in want
    ]  # enough tokens to compare
    towers_moved = _moved(want, lm_only)
    assert towers_moved > 1e-3, (
        f"the trained tower does not change the outputs ({towers_moved}): the check would be vacuous"
    )
    hf.update_weights(original, 0)  # back to the original weights for the other tests
    return trainer, want


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGLangTensorSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangDiskSync(timeout_s=120, bucket_bytes=1 << 18),
        lambda: SGLangDistributedSync(timeout_s=120, bucket_bytes=1 << 18, backend="gloo"),
    ],
    ids=["sglang_tensor", "sglang_disk", "sglang_distributed"],
)
def test_megatron_media_weights_are_served_exactly(
    make, qwen3_vl, prompts, sync_prompts, hf_reference, megatron_vl
):
    """The trained LM and vision tower through the transport: the HF engine's greedy tokens and logprobs on
    the image and video prompts, every token of the new version; then the original weights again (whose
    outputs the server gives again)."""
    from relax.sglang.testing import load_weights

    engine, model_dir, _ = qwen3_vl
    trainer, want = megatron_vl
    # the original weights' outputs first: SGLang now holds the old tower's embeddings of these media, which
    # it must not serve after the update (the server patch clears them)
    assert max(_gaps(_generate(engine, prompts), hf_reference[1], prompts).values()) < 1e-4
    transport = make()
    version = engine.weight_version() + 1
    try:
        stats = transport.sync(trainer, [engine], version)
        assert stats["buckets"] >= 2 and stats["bytes"] > 0, stats
        assert engine.weight_version() == version
        got = _generate(engine, sync_prompts)
        gaps = _gaps(got, want, sync_prompts)
        assert max(gaps.values()) < 1e-4, gaps
        assert all(r.versions == [version] * len(r.response_ids) for r in got), [r.versions for r in got]
    finally:
        transport.close()
        load_weights(engine, model_dir, version + 1)  # the module's other tests expect the original weights
    assert max(_gaps(_generate(engine, prompts), hf_reference[1], prompts).values()) < 1e-4
