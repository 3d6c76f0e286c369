"""Each audio is encoded alone (``relax.omni.audio_per_item.encode_audio_per_item``): a row's logprobs do not
depend on which other rows share its micro-batch. Qwen3-Omni's audio encoder pads every 1 s feature chunk of a
call to the call's longest chunk without masking, so before this a sub-second clip batched with a longer one
was encoded differently than alone -- rollout and training disagreed on the same row."""

from __future__ import annotations

import pytest
import torch

from relax.core.context import PluginContext
from relax.core.data import Sample, collate
from relax.core.data_multimodal import unpack_media
from relax.core.multimodal_model import load_model, media_forward_kwargs
from relax.core.testing.trainer import torch_trainer
from relax.omni import synthetic
from relax.omni.processors import OmniProcessorParams, make_factory
from relax.omni.tiny_models import OMNI_FAMILIES, tiny_multimodal_dir

RESPONSE = [5, 6, 7, 8]


def audio_rows(family: str, model_dir: str, tmp_path) -> list[Sample]:
    """A 0.5 s clip (one short chunk) and a 1.6 s one (a full chunk and a part), one prompt each."""
    proc = make_factory(family)(OmniProcessorParams(), PluginContext(role="processor", model_path=model_dir))
    samples = []
    for i, seconds in enumerate((0.25, 0.8)):  # two_tones: two tones of ``seconds`` each
        synthetic.two_tones(tmp_path / f"{i}.wav", 440.0 + 110 * i, 220.0, seconds=seconds)
        content = [{"type": "audio", "audio": str(tmp_path / f"{i}.wav")}, {"type": "text", "text": "what?"}]
        p = proc.process([{"role": "user", "content": content}], [], f"t.jsonl:{i + 1}")
        samples.append(
            Sample(
                prompt_ids=list(p["prompt_ids"]),
                group_id=i,
                index_in_group=0,
                response_ids=list(RESPONSE),
                rollout_logprobs=[0.0] * len(RESPONSE),
                mm_inputs=p["inputs"],
            )
        )
    return samples


def forward_lps(model, batch: dict) -> torch.Tensor:
    """Response-token logprobs of one forward over ``batch`` (collated rows, media included)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    width = ids.shape[1] - batch["response_mask"].shape[1]
    with torch.no_grad():
        logits = model(**media_forward_kwargs(model, ids, mask, unpack_media(batch), width)).logits
    lps = torch.log_softmax(logits[:, width - 1 : -1].float(), -1)
    return lps.gather(-1, ids[:, width:, None]).squeeze(-1)


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_a_short_clips_logprobs_do_not_depend_on_its_micro_batch(family, tmp_path_factory, tmp_path):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    short, long = audio_rows(family, model_dir, tmp_path)
    pad = 0
    trainer = torch_trainer(model_dir, micro_batch_size=2)
    alone = trainer.forward_logprobs(collate([short], pad))[0]
    mixed = trainer.forward_logprobs(collate([short, long], pad))[0]
    assert (alone - mixed).abs().max() <= 1e-5, f"{family}: the short clip's row changed with its micro-batch"

    if family == "qwen3_omni":  # the stock encoder does depend on it: the test above can fail
        from transformers import AutoModelForImageTextToText

        stock = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        fixed = load_model(model_dir, "float32").eval()
        both = collate([short, long], pad)
        gap = (forward_lps(stock, collate([short], pad))[0] - forward_lps(stock, both)[0]).abs().max().item()
        assert gap > 1e-3, f"the stock Qwen3-Omni encoder no longer depends on its batch ({gap:.2e})"
        same = (forward_lps(fixed, collate([short], pad))[0] - forward_lps(fixed, both)[0]).abs().max().item()
        assert same <= 1e-5, same


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_audio_rows_run_packed_with_their_own_positions(family, tmp_path_factory, tmp_path):
    """``trainer.pack_sequences``: the two audio rows laid end to end, each with the 3-D positions the thinker's
    rope index gives its padded row (``ModelAdapter.rope_positions``, audio lengths from the feature mask): the
    padded forward's logprobs."""
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    batch = collate(audio_rows(family, model_dir, tmp_path), 0)
    want = torch_trainer(model_dir, micro_batch_size=2).forward_logprobs(batch)
    packed = torch_trainer(model_dir, micro_batch_size=2, pack_sequences=True)
    axes = []
    packed.model.register_forward_pre_hook(
        lambda _, args, kw: axes.append(kw["position_ids"].shape[0]), with_kwargs=True
    )
    got = packed.forward_logprobs(batch)
    assert want.abs().sum() > 0 and axes == [3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
