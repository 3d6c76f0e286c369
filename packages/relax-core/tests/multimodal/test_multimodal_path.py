"""The core multimodal path on the four tiny families: process -> generate -> collate -> train -> sync.

Per family, one chain over image / video (/ audio) rows: the engine generates with the prompt's media,
collate packs each row's media so that micro-batches of mixed rows carry exactly the processor's tensors,
the trainer's logprobs equal the rollout's within 1e-4 (fp32, model-computed M-RoPE positions on both
sides), one train step changes the weights, and after a weight sync the engine samples from the new ones.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.data_multimodal import row_media
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import run_async
from relax.core.testing.multimodal_processor import TinyMediaProcessor
from relax.core.testing.trainer import torch_trainer
from relax.omni.tiny_models import FAMILIES, OMNI_FAMILIES, tiny_multimodal_dir

G, MAX_NEW = 2, 5


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    from PIL import Image

    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(root / "shapes.png")
    np.save(root / "dot.npy", (rng.random((4, 56, 56, 3)) * 255).astype("uint8"))
    np.save(root / "tone.npy", np.sin(np.arange(8000) * 0.05).astype("float32"))
    return {
        "image": str(root / "shapes.png"),
        "video": f"file://{root / 'dot.npy'}",
        "audio": str(root / "tone.npy"),
    }


def rows_for(family: str, media: dict[str, str]) -> list[list[dict]]:
    kinds = ["image", "video"] + (["audio"] if family in OMNI_FAMILIES else [])
    rows = [
        [
            {
                "role": "user",
                "content": [{"type": k, k: media[k]}, {"type": "text", "text": f"what is in the {k}?"}],
            }
        ]
        for k in kinds
    ]
    both = [{"type": "image", "image": media["image"]}, {"type": "video", "video": media["video"]}]
    text_only = [{"role": "user", "content": "no media here?"}]
    return [*rows, [{"role": "user", "content": [*both, {"type": "text", "text": "same?"}]}], text_only]


def requests_for(processed: list[dict], version: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"{version}/{i}/{j}",
            list(p["prompt_ids"]),
            SamplingParams(max_new_tokens=MAX_NEW, seed=7 * i + j),
            media=p["inputs"],
        )
        for i, p in enumerate(processed)
        for j in range(G)
    ]


def samples_for(processed: list[dict], results: list) -> list[Sample]:
    out = []
    for k, res in enumerate(results):
        p = processed[k // G]
        out.append(
            Sample(
                prompt_ids=list(p["prompt_ids"]),
                group_id=k // G,
                index_in_group=k % G,
                response_ids=list(res.response_ids),
                rollout_logprobs=list(res.logprobs),
                mm_inputs=p["inputs"],
                reward=float(k % 2),
            )
        )
    return out


def assert_parity(trainer, batch, results) -> float:
    got = trainer.forward_logprobs(batch)
    diff = 0.0
    for i, res in enumerate(results):
        n = len(res.logprobs)
        diff = max(diff, (got[i, :n] - torch.tensor(res.logprobs)).abs().max().item())
    assert diff <= 1e-4, f"rollout vs trainer logprobs differ by {diff}"
    return diff


@pytest.mark.parametrize("family", FAMILIES)
def test_media_roundtrip_generate_train_sync(family, media, tmp_path_factory):
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    processor = TinyMediaProcessor(model_dir)
    processed = [
        processor.process(m, [], f"rows.jsonl:{i + 1}") for i, m in enumerate(rows_for(family, media))
    ]
    assert processor.calls == len(processed)
    engine = HFRolloutEngine(model_dir)
    results = run_async(engine.generate(requests_for(processed)), 120)
    assert all(0 < len(r.response_ids) <= MAX_NEW and r.finish_reason in ("stop", "length") for r in results)
    engine.media_kv_cache = False  # the reference: a full forward with the media for every token
    reference = run_async(engine.generate(requests_for(processed)), 120)
    engine.media_kv_cache = True
    for got, want in zip(results, reference, strict=True):  # KV-cached decoding: same tokens, same logprobs
        assert got.response_ids == want.response_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-5

    samples = samples_for(processed, results)
    batch = collate(samples, engine.pad_token_id)
    for i, s in enumerate(samples):  # each row carries exactly its prompt's processor tensors
        want = {k: v for k, v in s.mm_inputs.items() if k != "mm_token_type_ids"}
        got = row_media(batch, i)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), f"row {i}"
    trainer = torch_trainer(model_dir, micro_batch_size=3)  # micro-batches mix rows of different media
    assert_parity(trainer, batch, results)

    before = {n: t.clone() for n, t in trainer.state_dict_for_sync().items()}
    advantages = torch.tensor([1.0 if s.reward else -1.0 for s in samples])[:, None].expand_as(
        batch["response_mask"]
    )
    trainer.train_step({**batch, "advantages": advantages.contiguous()})
    after = trainer.state_dict_for_sync()
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert any(".visual." in n or n.startswith(("visual.", "model.visual")) for n in changed), (
        "vision tower not trained"
    )
    assert len(changed) > len(before) // 2

    engine.update_weights(after, version=1)
    new_results = run_async(engine.generate(requests_for(processed, version=1)), 120)
    assert all(v == 1 for r in new_results for v in r.versions)
    new_batch = collate(samples_for(processed, new_results), engine.pad_token_id)
    assert_parity(trainer, new_batch, new_results)  # the engine now samples from the trained weights
    old_lp = torch.tensor([lp for r in results for lp in r.logprobs[:1]])
    new_on_old = trainer.forward_logprobs(batch)[:, 0]
    assert not torch.allclose(old_lp, new_on_old, atol=1e-4), "the train step did not change the policy"


def test_frozen_towers_are_not_trained_nor_synced(media, tmp_path_factory):
    """``freeze_media_towers``: vision and audio towers keep their loaded weights and are left out of the
    sync; the language model trains, and the engine (partial sync) still agrees with the trainer."""
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen3_omni")
    processor = TinyMediaProcessor(model_dir)
    processed = [
        processor.process(m, [], f"rows.jsonl:{i + 1}") for i, m in enumerate(rows_for("qwen3_omni", media))
    ]
    engine = HFRolloutEngine(model_dir)
    results = run_async(engine.generate(requests_for(processed)), 120)
    samples = samples_for(processed, results)
    batch = collate(samples, engine.pad_token_id)
    trainer = torch_trainer(model_dir, micro_batch_size=4, freeze_media_towers=True)
    assert trainer.frozen_towers == {"vision", "audio"}
    loaded = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    advantages = torch.tensor([1.0 if s.reward else -1.0 for s in samples])[:, None].expand_as(
        batch["response_mask"]
    )
    trainer.train_step({**batch, "advantages": advantages.contiguous()})
    now = trainer.model.state_dict()
    towers = [n for n in now if n.startswith(("model.visual.", "model.audio_tower."))]
    assert any("audio_tower" in n for n in towers) and any("visual" in n for n in towers)
    assert all(torch.equal(now[n], loaded[n]) for n in towers), "a frozen tower changed"
    assert any(not torch.equal(now[n], loaded[n]) for n in now if n.startswith("model.language_model."))
    synced = trainer.state_dict_for_sync()
    assert synced and not set(synced) & set(towers)
    engine.update_weights(synced, version=1)
    new_results = run_async(engine.generate(requests_for(processed, version=1)), 120)
    assert_parity(trainer, collate(samples_for(processed, new_results), engine.pad_token_id), new_results)


TOWERS = {"vision": "model.visual.", "audio": "model.audio_tower."}  # the in-memory HF names of each kind


def fixed_batch(model_dir: str, media: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every kind of row of ``rows_for`` with G fixed responses each (no rollout), rewards 1 / 0: advantages +-1."""
    processor = TinyMediaProcessor(model_dir)
    processed = [
        processor.process(m, [], f"rows.jsonl:{i + 1}") for i, m in enumerate(rows_for("qwen2_5_omni", media))
    ]
    answers = [processor.hf.tokenizer.encode(t) for t in ("a red dot", "a tone")]
    samples = [
        Sample(
            prompt_ids=list(p["prompt_ids"]),
            group_id=i,
            index_in_group=j,
            response_ids=answers[j],
            mm_inputs=p["inputs"],
            reward=float(j == 0),
        )
        for i, p in enumerate(processed)
        for j in range(G)
    ]
    batch = collate(samples, processor.hf.tokenizer.pad_token_id)
    advantages = torch.tensor([1.0 if s.reward else -1.0 for s in samples])[:, None].expand_as(
        batch["response_mask"]
    )
    return {**batch, "advantages": advantages.contiguous()}


@pytest.mark.parametrize("kind", ["vision", "audio"])
def test_one_kind_of_tower_frozen_is_neither_trained_nor_synced(kind, media, tmp_path_factory):
    """``freeze_vision`` / ``freeze_audio`` on the Qwen2.5-Omni thinker: the step leaves that tower as loaded
    and the export leaves it out; the other tower trains and is exported, the language model too."""
    from relax.core.testing.trainer import exported

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_omni")
    trainer = torch_trainer(model_dir, micro_batch_size=4, **{f"freeze_{kind}": True})
    assert trainer.frozen_towers == {kind}
    frozen, other = TOWERS[kind], TOWERS["audio" if kind == "vision" else "vision"]
    loaded = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    assert any(n.startswith(frozen) for n in loaded) and any(n.startswith(other) for n in loaded)
    trainer.train_step(fixed_batch(model_dir, media))
    now = trainer.model.state_dict()
    assert all(torch.equal(now[n], loaded[n]) for n in now if n.startswith(frozen)), (
        f"the frozen {kind} tower changed"
    )
    for prefix in (other, "model.language_model."):
        assert any(not torch.equal(now[n], loaded[n]) for n in now if n.startswith(prefix)), (
            f"{prefix}* not trained"
        )
    names = set(exported(trainer))
    assert not any(n.startswith(frozen) for n in names)
    assert {n for n in names if n.startswith(other)} == {n for n in now if n.startswith(other)}


def test_a_freeze_switch_for_a_tower_the_model_lacks_names_the_field(tmp_path_factory):
    """``freeze_audio`` on a VL model (no audio tower) is a wrong model for the run: refused naming the field;
    ``freeze_media_towers`` freezes what the model has (its vision tower), as before."""
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    with pytest.raises(
        ValueError,
        match=r"trainer\.backend_params\.freeze_audio: true, but the model \(model_type "
        r"'qwen2_5_vl'\) has no audio tower \(its towers: \['vision'\]\)",
    ):
        torch_trainer(model_dir, freeze_audio=True)
    trainer = torch_trainer(model_dir, freeze_media_towers=True)
    assert trainer.frozen_towers == {"vision"}
    assert {n for n, p in trainer.model.named_parameters() if not p.requires_grad} == {
        n for n, _ in trainer.model.named_parameters() if n.startswith(TOWERS["vision"])
    }


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_omni"])
def test_text_only_requests_on_a_multimodal_model_use_the_kv_path(family, tmp_path_factory):
    """No media on the request: the batched KV-cache path, 1-D positions, still equal to the trainer's."""
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    engine = HFRolloutEngine(model_dir)
    prompts = [engine.tokenizer.encode("hello there?"), engine.tokenizer.encode("1+1=?")]
    requests = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=MAX_NEW, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = run_async(engine.generate(requests), 60)
    assert engine.stats["prefill_rows"] == 2  # went through the batcher, not the media path
    mixed = run_async(engine.generate([requests[0], replace(requests[1], request_id="m", media={})]), 60)
    assert mixed[0].response_ids == results[0].response_ids  # a call mixing both paths: same tokens
    samples = [
        Sample(prompt_ids=p, group_id=i, response_ids=r.response_ids)
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    assert_parity(torch_trainer(model_dir), collate(samples, engine.pad_token_id), results)


def test_weight_update_mid_group_reprefills_with_the_new_weights(media, tmp_path_factory):
    """KV-cached media decoding across a weight update: a group whose rows finish at different lengths is
    re-prefilled (live rows only) with the new weights, and the tokens after the update are scored by them."""
    from relax.core.multimodal_model import media_forward_kwargs

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    processed = TinyMediaProcessor(model_dir).process(rows_for("qwen2_5_vl", media)[0], [], "rows.jsonl:1")
    engine = HFRolloutEngine(model_dir)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in engine.model.state_dict().items()}
    prompt, inputs = list(processed["prompt_ids"]), processed["inputs"]
    requests = [
        GenerationRequest(
            f"w{n}", prompt, SamplingParams(max_new_tokens=n, seed=n, ignore_eos=True), media=inputs
        )
        for n in (2, 6)
    ]

    async def scenario():
        task = asyncio.ensure_future(engine.generate(requests))
        while engine.stats["decode_rows"] < 2 + 2 + 1:  # three steps: the short row finished after two
            await asyncio.sleep(0)
        engine.update_weights(new, version=1)
        return await asyncio.wait_for(task, 60)

    short, long = asyncio.run(scenario())
    assert short.versions == [0, 0] and long.versions == [0, 0, 0, 1, 1, 1]
    ids = torch.tensor([prompt + long.response_ids])
    kwargs = media_forward_kwargs(engine.model, ids, torch.ones_like(ids), inputs, len(prompt))
    with torch.no_grad():
        lps = torch.log_softmax(engine.model(**kwargs).logits[0, len(prompt) - 1 : -1], -1)
    want = lps.gather(-1, torch.tensor(long.response_ids)[:, None]).squeeze(-1)[3:]
    assert (want - torch.tensor(long.logprobs[3:])).abs().max() <= 1e-5


def test_source_entries_reach_no_model_nor_batch(media, tmp_path_factory):
    """``source.*`` entries (original media kept for engines that re-process it, e.g. sglang's audio
    waveforms) change nothing: the same tokens and logprobs from the engine, no ``mm.source.*`` key in the
    training batch, the same trainer logprobs."""
    from relax.core.data_multimodal import source_media
    from relax.core.multimodal_model import media_forward_kwargs

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen3_omni")
    plain = TinyMediaProcessor(model_dir).process(
        rows_for("qwen3_omni", media)[2], [], "rows.jsonl:3"
    )  # audio row
    waves = {
        f"source.audio.{i}": torch.full((5 + i,), float(i)) for i in (1, 0)
    }  # any shape: never fed anywhere
    kept = {**plain, "inputs": {**plain["inputs"], **waves}}
    assert [w[0].item() for w in source_media(kept["inputs"], "audio")] == [
        0.0,
        1.0,
    ]  # item order, not key order
    engine = HFRolloutEngine(model_dir)
    want, got = (run_async(engine.generate(requests_for([p])), 60) for p in (plain, kept))
    assert [(r.response_ids, r.logprobs) for r in got] == [(r.response_ids, r.logprobs) for r in want]
    batches = [collate(samples_for([p], want), engine.pad_token_id) for p in (plain, kept)]
    assert batches[0].keys() == batches[1].keys() and not any("source" in k for k in batches[1])
    assert all(torch.equal(batches[0][k], batches[1][k]) for k in batches[0])
    trainer = torch_trainer(model_dir)
    assert torch.equal(trainer.forward_logprobs(batches[1]), trainer.forward_logprobs(batches[0]))
    kwargs = media_forward_kwargs(
        engine.model,
        torch.tensor([plain["prompt_ids"]]),
        torch.ones(1, len(plain["prompt_ids"])),
        kept["inputs"],
        1,
    )
    assert not any(k.startswith("source.") for k in kwargs)
