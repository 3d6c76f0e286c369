"""The ``sglang`` engine against a real SGLang server on CPU (one shared server per session)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import LogprobAgreementConformance, RolloutEngineConformance, torch_trainer
from relax.core.testing.models import MODEL_SEED, tiny_model_dir


def _shared_or_hf(model_dir: str, root) -> object:
    """The session's server for the kit's model; core's HF engine as the reference for any other model
    (the kit's update-weights check compares against an engine built on the new weights -- a second
    server would cost a minute of start-up for an answer the HF engine gives exactly)."""
    from relax.sglang.testing import shared_engine

    if model_dir == tiny_model_dir(root, MODEL_SEED):
        return shared_engine(model_dir, str(root / "sglang-run"))
    from relax.core.engines.hf import HFRolloutEngine

    return HFRolloutEngine(model_dir)


class _OnSharedServer:
    """The kits' engine: the session's server (see ``_shared_or_hf``)."""

    timeout_s = 300.0

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _root(cls, tmp_path_factory, sglang_python):
        cls.root = tmp_path_factory.getbasetemp()

    def make_engine(self, model_dir):
        return _shared_or_hf(model_dir, self.root)


class TestSGLangConformance(_OnSharedServer, RolloutEngineConformance):
    pause_probe_s = 1.0


class TestSGLangAgreesWithTorchTrainer(_OnSharedServer, LogprobAgreementConformance):
    def make_trainer(self, model_dir):
        return torch_trainer(model_dir)


def _run(coro, timeout_s: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_greedy_equals_hf_generate(sglang_engine, tiny_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[0], dtype=torch.float32).eval()
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11], [12]]
    reqs = [
        GenerationRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    results = _run(sglang_engine.generate(reqs))
    for p, r in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert r.response_ids == out[0, len(p) :].tolist(), (
            f"prompt {p}: SGLang {r.response_ids} vs HF {out[0, len(p) :].tolist()}"
        )
        assert r.finish_reason == "length" and r.versions == [sglang_engine.weight_version()] * 10


@pytest.fixture(scope="module")
def vl_engine(sglang_python, tmp_path_factory):
    """(engine, model dir): the one extra SGLang launch of the suite, on the tiny Qwen2.5-VL (same flags as
    the shared server), closed when the module is done."""
    from relax.omni.tiny_models import tiny_multimodal_dir
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.testing import engine_params

    root = tmp_path_factory.getbasetemp()
    model_dir = tiny_multimodal_dir(root, "qwen2_5_vl")
    engine = SGLangEngine(engine_params(), model_dir, run_dir=str(root / "sglang-vl-run"))
    yield engine, model_dir
    engine.close()


def test_multimodal_generation(vl_engine, tmp_path):
    """An image request (relax-omni's processed prompt) through SGLang over HTTP: greedy tokens equal HF
    ``generate`` on the same processed inputs, and the sampled-token logprobs equal the HF forward's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from relax.core.testing.multimodal import write_media
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    engine, model_dir = vl_engine
    proc = QwenOmniProcessor(
        AutoProcessor.from_pretrained(model_dir), FAMILIES["qwen2_5_vl"], OmniProcessorParams()
    )
    media = write_media(tmp_path)
    content = [{"type": "image", "image": media["image"]}, {"type": "text", "text": "what is it?"}]
    prompt = proc.process([{"role": "user", "content": content}], [], "t.jsonl:1")
    ids, inputs = prompt["prompt_ids"], prompt["inputs"]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    reqs = [
        GenerationRequest(f"vl{i}", ids, params, media=inputs) for i in range(2)
    ]  # a group shares its media
    results = _run(engine.generate(reqs))

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, hf_lps = _hf_reference(model, ids, inputs, 8)
    for r in results:
        assert r.response_ids == out, f"SGLang {r.response_ids} vs HF {out}"
        gap = (torch.tensor(r.logprobs) - hf_lps).abs().max().item()
        assert gap < 1e-4, f"SGLang vs HF forward logprobs differ by {gap}"  # measured 2.6e-6
        assert r.finish_reason == "length"


def _hf_reference(model, ids, inputs, n):
    """HF greedy tokens for the processed prompt and the forward's logprobs of them."""
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=mask,
            **inputs,
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
        )[0, len(ids) :].tolist()
        full = torch.tensor([ids + out])
        types = inputs["mm_token_type_ids"]  # per prompt token: extend over the response (text)
        fwd = {**inputs, "mm_token_type_ids": torch.cat([types, types.new_zeros(1, len(out))], 1)}
        logits = model(input_ids=full, attention_mask=torch.ones_like(full), **fwd).logits[0].float()
    return out, torch.log_softmax(logits[len(ids) - 1 : -1], -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def test_video_generation(vl_engine, tmp_path, monkeypatch):
    """Video requests (relax-omni's processed prompts) through SGLang over HTTP: SGLang's prompt lengths are
    ours and its greedy tokens equal HF ``generate``. For a 2-frame video (one temporal grid) its logprobs
    equal the HF forward's; for a 4-frame one (two grids) once HF's vision attention spans the whole clip,
    as SGLang 0.5.23's Qwen2.5-VL does (HF attends per temporal grid: measured 0.061 apart, 7.4e-6 without)."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen2_5_vl
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from relax.omni import synthetic
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    engine, model_dir = vl_engine
    prompts = []
    for name, frames, max_frames in (
        ("one_grid", 4, 2),
        ("two_grids", 8, 64),
    ):  # 1 s / 2 s at 4 fps, sampled at 2
        synthetic.moving_dot_video(tmp_path / f"{name}.mp4", right=True, frames=frames)
        proc = QwenOmniProcessor(
            AutoProcessor.from_pretrained(model_dir),
            FAMILIES["qwen2_5_vl"],
            OmniProcessorParams(max_frames=max_frames),
        )
        content = [
            {"type": "video", "video": str(tmp_path / f"{name}.mp4")},
            {"type": "text", "text": "where?"},
        ]
        prompt = proc.process([{"role": "user", "content": content}], [], f"t.jsonl:{name}")
        prompts.append((prompt["prompt_ids"], prompt["inputs"]))
    assert [inputs["video_grid_thw"][0, 0].item() for _, inputs in prompts] == [1, 2]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    results = _run(
        engine.generate(
            [GenerationRequest(f"v{i}", ids, params, media=inputs) for i, (ids, inputs) in enumerate(prompts)]
        )
    )

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    references = [_hf_reference(model, *prompts[0], 8)]
    clip_wide = qwen2_5_vl.get_vision_attention_seqlens
    monkeypatch.setattr(
        qwen2_5_vl,
        "get_vision_attention_seqlens",
        lambda grid, config, merge_temporal=False, kwargs=None: clip_wide(grid, config, True, kwargs),
    )
    references.append(_hf_reference(model, *prompts[1], 8))
    for result, (out, hf_lps) in zip(results, references, strict=True):
        assert result.response_ids == out, f"{result.request_id}: SGLang {result.response_ids} vs HF {out}"
        gap = (torch.tensor(result.logprobs) - hf_lps).abs().max().item()
        assert gap < 1e-4, (
            f"{result.request_id}: SGLang vs HF forward logprobs differ by {gap}"
        )  # 9.9e-6, 7.4e-6


def test_health_reports_a_live_server(sglang_engine):
    health = sglang_engine.health()
    assert health["ok"] is True and health["url"] == sglang_engine.url, health


def test_released_memory_comes_back_with_the_same_weights(sglang_engine):
    """``rollout.release_memory``'s two calls on the real server: SGLang's release/resume path runs (on CPU it
    frees nothing -- the memory saver is CUDA-only, see test_gpu.py) and the server then serves exactly
    what it served before, at the same version."""
    reqs = [
        GenerationRequest(
            f"m{i}", [4 + i, 5, 6], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        )
        for i in range(3)
    ]
    before = _run(sglang_engine.generate(reqs))
    sglang_engine.release_memory()
    sglang_engine.resume_memory()
    after = _run(sglang_engine.generate(reqs))
    assert [r.response_ids for r in after] == [r.response_ids for r in before]
    gap = max(
        (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        for a, b in zip(after, before, strict=True)
    )
    assert gap < 1e-5, gap  # 2e-6: the release flushed the prefix cache, so the prompts are prefilled anew
    assert sglang_engine.health()["ok"] and {v for r in after for v in r.versions} == {
        sglang_engine.weight_version()
    }
