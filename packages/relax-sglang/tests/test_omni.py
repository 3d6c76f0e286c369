"""Audio and video through SGLang over HTTP on a tiny Qwen3-Omni thinker (its own server launch, ~76-95 s on the 2-core
machine: over the suite's budget, so it runs only with ``RELAX_SGLANG_OMNI=1``)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("RELAX_SGLANG_OMNI") != "1",
    reason="launches a Qwen3-Omni SGLang server (~76-95 s on 2 CPU cores); set RELAX_SGLANG_OMNI=1 to run",
)


@pytest.fixture(scope="module")
def omni_engine(sglang_python, tmp_path_factory):
    """(engine, thinker dir): SGLang serving the tiny Qwen3-Omni, closed when the module is done."""
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.testing import engine_params, tiny_omni_dirs

    root = tmp_path_factory.getbasetemp()
    server_dir, thinker_dir = tiny_omni_dirs(root)
    engine = SGLangEngine(engine_params(), server_dir, run_dir=str(root / "sglang-omni-run"))
    yield engine, thinker_dir
    engine.close()


def hf_greedy(model, ids: list[int], inputs: dict, n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens for the prompt and its media (full forwards; EOS may be sampled, as SGLang's
    ``ignore_eos`` does -- ``generate``'s ``min_new_tokens`` would ban it instead) and their logprobs."""
    from relax.core.data_multimodal import model_inputs

    media = model_inputs(inputs)  # without the source.audio.<i> waveforms (no model input)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n + 1):
            full = torch.tensor([ids + out])
            logits = model(input_ids=full, attention_mask=torch.ones_like(full), **media).logits[0].float()
            if len(out) == n:
                break
            out.append(int(logits[-1].argmax()))
    return out, torch.log_softmax(logits[len(ids) - 1:-1], -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def test_audio_and_video_prompts_through_the_engine_equal_hf(omni_engine, tmp_path):
    """Audio and video prompts processed by relax-omni go through ``SGLangEngine.generate`` in one call:
    SGLang's features expand each prompt to our length (the engine checks), its greedy tokens equal HF's on
    the processed inputs, and its logprobs the HF forward's.

    Audio (the kept ``source.audio.<i>`` waveforms, sent as float PCM): one prompt of one audio (two requests
    sharing it), one of two audios of other lengths (waveforms kept in prompt order), one of a 0.5 s clip.
    SGLang gets them in one prefill batch, which crashed stock SGLang 0.5.23 (different widths) and would
    encode the sub-second clip padded to the others' 1 s chunks; Relax's server patch encodes each audio
    alone, as Relax's HF models do (``encode_audio_per_item``). Video (sent as for Qwen2.5-VL): one of one
    temporal grid and one of two -- the second needs the server patch's ``fps`` (SGLang would give the
    processor 1.0, doubling each grid's M-RoPE seconds: other greedy tokens) and its kept frame size."""
    from transformers import AutoProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

    from relax.core.protocols import GenerationRequest, SamplingParams
    from relax.omni import synthetic
    from relax.omni.audio_per_item import encode_audio_per_item
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    engine, thinker_dir = omni_engine
    hf = AutoProcessor.from_pretrained(thinker_dir)
    proc = QwenOmniProcessor(hf, FAMILIES["qwen3_omni"], OmniProcessorParams())
    two_frames = QwenOmniProcessor(hf, FAMILIES["qwen3_omni"], OmniProcessorParams(max_frames=2))  # one grid
    synthetic.two_tones(tmp_path / "a.wav", 440.0, 220.0, seconds=0.6)  # 1.2 s
    synthetic.two_tones(tmp_path / "b.wav", 330.0, 550.0, seconds=0.8)  # 1.6 s
    synthetic.two_tones(tmp_path / "c.wav", 660.0, 330.0, seconds=0.25)  # 0.5 s: one short chunk
    for name, frames in (("one", 4), ("two", 8)):  # 1 s / 2 s at 4 fps, sampled at 2 fps
        synthetic.moving_dot_video(tmp_path / f"{name}.mp4", right=name == "one", frames=frames)
    audio, longer, short = str(tmp_path / "a.wav"), str(tmp_path / "b.wav"), str(tmp_path / "c.wav")
    rows = [(proc, [{"type": "audio", "audio": audio}, {"type": "text", "text": "what?"}]),
            (proc, [{"type": "audio", "audio": longer}, {"type": "text", "text": "then"},
                    {"type": "audio", "audio": audio}, {"type": "text", "text": "same?"}]),
            (proc, [{"type": "audio", "audio": short}, {"type": "text", "text": "short?"}]),
            (two_frames, [{"type": "video", "video": str(tmp_path / "one.mp4")}, {"type": "text", "text": "where?"}]),
            (proc, [{"type": "video", "video": str(tmp_path / "two.mp4")}, {"type": "text", "text": "where?"}])]
    prompts = [p.process([{"role": "user", "content": c}], [], f"t.jsonl:{i + 1}") for i, (p, c) in enumerate(rows)]
    assert [sum(k.startswith("source.audio.") for k in p["inputs"]) for p in prompts] == [1, 2, 1, 0, 0]
    assert [p["inputs"]["video_grid_thw"][0, 0].item() for p in prompts[3:]] == [1, 2]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    requests = [GenerationRequest(f"a{j}", list(p["prompt_ids"]), greedy, media=p["inputs"])
                for j, p in enumerate([prompts[0], *prompts])]
    results = asyncio.run(asyncio.wait_for(engine.generate(requests), 300))

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(thinker_dir, dtype=torch.float32).eval()
    assert encode_audio_per_item(model) == 1  # as relax-omni's model adapter does on load
    gaps = []
    for req, res in zip(requests, results, strict=True):
        want, want_lps = hf_greedy(model, req.prompt_ids, req.media, 8)
        assert res.response_ids == want, f"{req.request_id}: SGLang {res.response_ids} vs HF {want}"
        gaps.append((torch.tensor(res.logprobs) - want_lps).abs().max().item())
    print(f"SGLang vs HF forward logprob gaps: {gaps}")
    assert max(gaps) < 1e-4, f"SGLang vs HF forward logprobs differ by {gaps}"  # measured 2.4e-7 .. 4.8e-7



def test_a_trained_thinker_is_refused_before_it_reaches_the_server(omni_engine):
    """SGLang serves Qwen3-Omni whole (``thinker.*``, the checkpoint's expert layout) and skips names it does not hold:
    a trainer's export of the thinker (transformers' in-memory names) would leave the weights as they were under the new
    version, or kill the server on a fused expert's shape (both seen). The engine refuses it, naming what to use; the
    server keeps serving, and the checkpoint's own names still load."""
    from relax.core.testing.models import load_hf_weights
    from relax.sglang.testing import load_weights

    engine, thinker_dir = omni_engine
    served = engine.weight_version()
    exported = list(load_hf_weights(thinker_dir).items())[:3]  # thinker names, as a trainer exports them
    with pytest.raises(ValueError, match="cannot be synced into SGLang yet; use rollout.engine: hf"):
        engine.update_weights(exported, served + 1)
    with pytest.raises(ValueError, match="cannot be synced into SGLang yet"):
        engine.update_weights_from_disk(str(thinker_dir), served + 1)
    assert engine.health()["ok"] and engine.weight_version() == served
    server_dir = engine.model_path
    load_weights(engine, server_dir, served + 1)  # the served checkpoint's own (``thinker.``) names
    assert engine.weight_version() == served + 1
