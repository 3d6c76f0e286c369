"""``use_audio_in_video`` through the model path: a video row with its soundtrack is processed (the soundtrack's
audio tokens interleaved with the video's), generated, scored and trained by the trainer with the same
interleaved M-RoPE positions -- rollout = trainer logprobs within 1e-4 (fp32) and both equal a direct HF forward
told ``use_audio_in_video=True`` (without the flag the rope index silently mis-places audio and video)."""

from __future__ import annotations

import shutil

import pytest
import torch

from relax.core.context import PluginContext
from relax.core.data import Sample, collate
from relax.core.data_multimodal import model_inputs
from relax.core.engines.hf import HFRolloutEngine
from relax.core.multimodal_model import media_forward_kwargs, media_token_ids
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import run_async
from relax.core.testing.trainer import torch_trainer
from relax.omni.adapters import AUDIO_IN_VIDEO
from relax.omni.processors import OmniProcessorParams, make_factory
from relax.omni.tiny_models import OMNI_FAMILIES, PLACEHOLDERS, tiny_multimodal_dir

pytestmark = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="use_audio_in_video needs ffmpeg")
PARAMS = OmniProcessorParams(
    min_pixels=56 * 56,
    max_pixels=112 * 112,
    video_min_pixels=28 * 28,
    video_max_pixels=56 * 56,
    max_frames=4,
    use_audio_in_video=True,
)


def direct_logprobs(model, ids: torch.Tensor, inputs: dict, prompt_len: int, flag: bool) -> torch.Tensor:
    """Response-token logprobs of a plain HF forward over prompt + response (temperature 1; media ids a
    response sampled are fed as token 0, as engine and trainer do)."""
    media = {k: v for k, v in model_inputs(inputs).items() if k != AUDIO_IN_VIDEO}
    fed = ids.clone()
    fed[:, prompt_len:][torch.isin(ids[:, prompt_len:], torch.tensor(media_token_ids(model.config)))] = 0
    with torch.no_grad():
        logits = model(
            input_ids=fed, attention_mask=torch.ones_like(ids), use_audio_in_video=flag, **media
        ).logits
    lps = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)
    return lps.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_video_with_soundtrack_generates_and_trains_with_interleaved_positions(
    family, media, tmp_path_factory, assert_source_audio
):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    proc = make_factory(family)(PARAMS, PluginContext(role="processor", model_path=model_dir))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(media / "dot_sound.mp4")},
                {"type": "text", "text": "which way?"},
            ],
        }
    ]
    p = proc.process(messages, [], "t.jsonl:1")
    assert p["counts"] == {"image": 0, "video": 1, "audio": 1}
    assert p["inputs"][AUDIO_IN_VIDEO].tolist() == [1]
    assert_source_audio(proc, p["inputs"], 1)  # the soundtrack's waveform is kept too
    ids, tok = p["prompt_ids"], proc.tokenizer
    video, audio = (tok.convert_tokens_to_ids(PLACEHOLDERS[family][k][1]) for k in ("video", "audio"))
    audio_start = tok.convert_tokens_to_ids(PLACEHOLDERS[family]["audio"][0])
    first = ids.index(video)  # the video block opens with the audio start, then frames and sound by chunk
    assert ids[first - 1] == audio_start and ids.count(audio) > 0
    assert ids.index(audio) > first and max(i for i, t in enumerate(ids) if t == video) < len(ids)

    engine = HFRolloutEngine(model_dir)
    requests = [
        GenerationRequest(f"r{j}", list(ids), SamplingParams(max_new_tokens=4, seed=j), media=p["inputs"])
        for j in range(2)
    ]
    results = run_async(engine.generate(requests), 120)
    samples = [
        Sample(
            prompt_ids=list(ids),
            group_id=0,
            index_in_group=j,
            response_ids=list(r.response_ids),
            rollout_logprobs=list(r.logprobs),
            mm_inputs=p["inputs"],
        )
        for j, r in enumerate(results)
    ]
    batch = collate(samples, engine.pad_token_id)
    trainer = torch_trainer(model_dir, micro_batch_size=2)
    got = trainer.forward_logprobs(batch)
    for i, r in enumerate(results):
        rollout = torch.tensor(r.logprobs)
        assert (got[i, : len(rollout)] - rollout).abs().max() <= 1e-4, "rollout vs trainer logprobs"
        full = torch.tensor([ids + r.response_ids])
        told = direct_logprobs(engine.model, full, p["inputs"], len(ids), True)[0]
        assert (told - rollout).abs().max() <= 1e-4, "rollout vs HF forward with use_audio_in_video=True"
        untold = direct_logprobs(engine.model, full, p["inputs"], len(ids), False)[0]
        assert (untold - rollout).abs().max() > 1e-3, (
            "the flag made no difference: positions not interleaved?"
        )

    # one train step on the row: gradients reach both towers through the interleaved tokens
    before = {n: t.clone() for n, t in trainer.state_dict_for_sync().items()}
    advantages = torch.tensor([[1.0], [-1.0]]).expand_as(batch["response_mask"]).contiguous()
    trainer.train_step({**batch, "advantages": advantages})
    after = trainer.state_dict_for_sync()
    moved = {
        n.split(".")[1] for n in before if n.startswith("model.") and not torch.equal(before[n], after[n])
    }
    assert {"audio_tower", "visual", "language_model"} <= moved, moved

    # a batch whose videos disagree on the flag cannot get one rope index: a clear error, not wrong positions
    plain = {k: v for k, v in p["inputs"].items()}
    plain[AUDIO_IN_VIDEO] = torch.ones(0, dtype=torch.long)
    plain["video_grid_thw"] = torch.cat([plain["video_grid_thw"]] * 2)
    with pytest.raises(ValueError, match=r"mixes videos with and without their soundtrack \(0 of 2 videos"):
        media_forward_kwargs(engine.model, torch.tensor([ids]), torch.ones(1, len(ids)), plain, len(ids))
