"""Audio and video through SGLang over HTTP on a tiny Qwen3-Omni thinker, and trained thinkers (the megatron
trainer's and core's torch trainer's) synced into it through each ``sglang_*`` transport (one server launch for the
module, ~25-90 s on the 2-core machine)."""

from __future__ import annotations

import asyncio

import pytest
import torch


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
    return out, torch.log_softmax(logits[len(ids) - 1 : -1], -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


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
    rows = [
        (proc, [{"type": "audio", "audio": audio}, {"type": "text", "text": "what?"}]),
        (
            proc,
            [
                {"type": "audio", "audio": longer},
                {"type": "text", "text": "then"},
                {"type": "audio", "audio": audio},
                {"type": "text", "text": "same?"},
            ],
        ),
        (proc, [{"type": "audio", "audio": short}, {"type": "text", "text": "short?"}]),
        (
            two_frames,
            [{"type": "video", "video": str(tmp_path / "one.mp4")}, {"type": "text", "text": "where?"}],
        ),
        (proc, [{"type": "video", "video": str(tmp_path / "two.mp4")}, {"type": "text", "text": "where?"}]),
    ]
    prompts = [
        p.process([{"role": "user", "content": c}], [], f"t.jsonl:{i + 1}") for i, (p, c) in enumerate(rows)
    ]
    assert [sum(k.startswith("source.audio.") for k in p["inputs"]) for p in prompts] == [1, 2, 1, 0, 0]
    assert [p["inputs"]["video_grid_thw"][0, 0].item() for p in prompts[3:]] == [1, 2]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    requests = [
        GenerationRequest(f"a{j}", list(p["prompt_ids"]), greedy, media=p["inputs"])
        for j, p in enumerate([prompts[0], *prompts])
    ]
    results = asyncio.run(asyncio.wait_for(engine.generate(requests), 300))

    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        thinker_dir, dtype=torch.float32
    ).eval()
    assert encode_audio_per_item(model) == 1  # as relax-omni's model adapter does on load
    gaps = []
    for req, res in zip(requests, results, strict=True):
        want, want_lps = hf_greedy(model, req.prompt_ids, req.media, 8)
        assert res.response_ids == want, f"{req.request_id}: SGLang {res.response_ids} vs HF {want}"
        gaps.append((torch.tensor(res.logprobs) - want_lps).abs().max().item())
    print(f"SGLang vs HF forward logprob gaps: {gaps}")
    assert max(gaps) < 1e-4, f"SGLang vs HF forward logprobs differ by {gaps}"  # measured 2.4e-7 .. 4.8e-7


@pytest.fixture(scope="module")
def sync_batch(omni_engine, tmp_path_factory):
    """(audio, image and video prompts stopping at generated media tokens (a case the engines need not agree on),
    a policy-gradient batch on them, core's HF engine's greedy results on them with the original weights)."""
    from transformers import AutoConfig, AutoProcessor

    from relax.core.data import Sample, collate
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.protocols import GenerationRequest, SamplingParams
    from relax.core.testing.multimodal import write_media
    from relax.omni import synthetic
    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    _, thinker_dir = omni_engine
    root = tmp_path_factory.mktemp("omni-sync-media")
    synthetic.two_tones(root / "a.wav", 440.0, 220.0, seconds=0.6)
    synthetic.moving_dot_video(root / "v.mp4", right=True, frames=8)
    image = write_media(root)["image"]
    proc = QwenOmniProcessor(
        AutoProcessor.from_pretrained(thinker_dir), FAMILIES["qwen3_omni"], OmniProcessorParams()
    )
    rows = [
        [{"type": "audio", "audio": str(root / "a.wav")}, {"type": "text", "text": "what?"}],
        [{"type": "image", "image": image}, {"type": "text", "text": "and"}],
        [{"type": "video", "video": str(root / "v.mp4")}, {"type": "text", "text": "where?"}],
    ]
    config = AutoConfig.from_pretrained(thinker_dir)
    stops = tuple(
        getattr(config, f"{k}_token_id")
        for k in ("image", "video", "audio", "vision_start", "vision_end", "audio_start", "audio_end")
    )
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, stop_token_ids=stops)
    prompts = []
    for i, content in enumerate(rows):
        p = proc.process([{"role": "user", "content": content}], [], f"t.jsonl:{i + 1}")
        prompts.append(GenerationRequest(f"s{i}", list(p["prompt_ids"]), greedy, media=p["inputs"]))
    answer = proc.tokenizer.encode("a tone and a dot moving right")
    samples = [
        Sample(prompt_ids=r.prompt_ids, group_id=i, response_ids=answer[i : i + 3], mm_inputs=r.media)
        for i, r in enumerate(prompts)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.tensor([1.0, -0.5, 1.0])[:, None] * batch["response_mask"]
    return prompts, batch, _generate(HFRolloutEngine(thinker_dir), prompts)


@pytest.fixture(scope="module", params=["megatron", "torch"])
def trained_thinker(request, omni_engine, sync_batch):
    """(the trainer after one policy-gradient step on ``sync_batch`` (towers trainable), the HF engine's greedy
    results with its exported weights). The megatron trainer loads the whole Qwen3-Omni checkpoint and exports
    experts one by one, core's torch trainer the thinker's and exports them fused as transformers holds them:
    both layouts the transports map."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.testing.trainer import exported

    _, thinker_dir = omni_engine
    prompts, batch, original = sync_batch
    objective = build_policy_objective(AlgorithmConfig())
    if request.param == "megatron":
        request.getfixturevalue("megatron_world")
        from relax.megatron.trainer import MegatronTrainer

        # from the whole checkpoint the server runs, as a user trains the released model
        trainer = MegatronTrainer(omni_engine[0].model_path, objective=objective, lr=1e-2, micro_batch_size=3)
    else:
        from relax.core.trainers.torch_trainer import TorchTrainer

        trainer = TorchTrainer(thinker_dir, objective=objective, lr=1e-2, micro_batch_size=3)
    trainer.train_step({**batch, "old_logprobs": trainer.forward_logprobs(batch)})
    weights = exported(trainer)
    fused = any(n.endswith("experts.gate_up_proj") for n in weights)
    assert fused == (request.param == "torch"), sorted(weights)[:8]
    towers = [n for n in weights if n.startswith(("model.visual.", "model.audio_tower."))]
    hf = HFRolloutEngine(thinker_dir)
    hf.update_weights({n: t for n, t in weights.items() if n not in towers}, 1)
    without_towers = _generate(hf, prompts)
    hf.update_weights(weights, 2)
    want = _generate(hf, prompts)
    assert sum(len(r.response_ids) for r in want) >= 6, [
        r.response_ids for r in want
    ]  # enough tokens to compare
    # the towers' share of the change alone moves the outputs: a sync that dropped them would fail
    assert _moved(want, without_towers) > 1e-3 and _moved(want, original) > 1e-3
    return trainer, want


def _generate(engine, requests: list) -> list:
    return asyncio.run(asyncio.wait_for(engine.generate(requests), 300))


def _moved(a: list, b: list) -> float:
    """The largest per-token logprob change between two runs of the same requests (inf: other tokens)."""
    if [r.response_ids for r in a] != [r.response_ids for r in b]:
        return float("inf")
    return max(
        abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra.logprobs, rb.logprobs, strict=True)
    )


def _assert_serves(engine, prompts: list, want: list, version: int | None = None) -> None:
    for req, g, w in zip(prompts, _generate(engine, prompts), want, strict=True):
        assert g.response_ids == w.response_ids, (
            f"{req.request_id}: SGLang {g.response_ids} vs HF {w.response_ids}"
        )
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
        assert version is None or g.versions == [version] * len(g.response_ids), g.versions


@pytest.mark.parametrize("transport", ["sglang_tensor", "sglang_disk", "sglang_distributed"])
def test_a_trained_thinker_is_served_exactly_through_each_transport(
    transport, omni_engine, sync_batch, trained_thinker
):
    """A trained Qwen3-Omni thinker (LM, MoE experts, vision and audio towers, one step of the megatron trainer or
    core's torch trainer) through the transport: SGLang serves Qwen3-Omni whole (``thinker.*``, the checkpoint's
    per-expert layout) and skips names it does not hold, so the transport maps the export
    (``relax.sglang.served_layout``). The HF engine's greedy tokens and logprobs on audio, image and video prompts,
    every token of the new version; then the served checkpoint again, whose outputs the server gives again."""
    from relax.core.testing.models import load_hf_weights
    from relax.sglang.testing import load_weights
    from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

    engine, thinker_dir = omni_engine
    prompts, _, original = sync_batch
    trainer, want = trained_thinker
    _assert_serves(engine, prompts, original)
    make = {
        "sglang_tensor": SGLangTensorSync,
        "sglang_disk": SGLangDiskSync,
        "sglang_distributed": SGLangDistributedSync,
    }
    sync = make[transport](timeout_s=120, bucket_bytes=1 << 18)
    version = engine.weight_version() + 1
    try:
        stats = sync.sync(trainer, [engine], version)
        assert stats["buckets"] >= 2 and stats["bytes"] > 0, stats
        _assert_serves(engine, prompts, want, version)
    finally:
        sync.close()
        load_weights(
            engine, engine.model_path, version + 1
        )  # the served checkpoint's own (``thinker.``) names
    _assert_serves(engine, prompts, original)
    exported = list(load_hf_weights(thinker_dir).items())[:3]  # a direct call with the thinker's own names
    with pytest.raises(ValueError, match="whose loader takes checkpoint names under 'thinker.'"):
        engine.update_weights(exported, version + 2)
    assert engine.health()["ok"] and engine.weight_version() == version + 1


def test_the_audio_quickstart_runs_on_the_whole_qwen3_omni_with_sglang_rollout(
    ray_session, omni_engine, sync_batch, tmp_path
):
    """``examples/quickstart_omni_audio.yaml`` (its tones and shapes) on the whole Qwen3-Omni checkpoint, as a user
    runs the released model: the megatron trainer loads its thinker, the module's SGLang server (attached by URL)
    rolls out audio and image prompts, and every step's weights reach the server through ``sglang_tensor`` (async,
    staleness 1). The run's final HF directory, and ``relax convert`` of its last checkpoint, are the whole
    checkpoint again: the server loads the directory from disk and serves the HF engine's greedy tokens."""
    import json
    from pathlib import Path

    from relax.core.config import load_config
    from relax.core.controller.run import run
    from relax.core.convert import convert
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.testing.models import load_hf_weights
    from relax.sglang.testing import load_weights

    engine, _ = omni_engine
    steps, run_dir = 3, tmp_path / "run"
    load_weights(engine, engine.model_path, 0)  # the run starts at version 0: so must the server
    example = Path(__file__).resolve().parents[3] / "examples" / "quickstart_omni_audio.yaml"
    cfg = load_config(
        str(example),
        [
            f"run_dir={run_dir}",
            f"model.path={engine.model_path}",
            "data.processor=qwen3_omni",
            f"total_steps={steps}",
            "mode=async",
            "max_staleness=1",
            "rollout.engine=sglang",
            f"rollout.engine_params.urls=[{engine.url}]",
            "weight_sync.transport=sglang_tensor",
            "trainer.backend=megatron",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "trainer.micro_batch_size=16",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
        ],
    )
    final, converted = run_dir / "final_hf", tmp_path / "converted"
    try:
        run(cfg)
        served = int(engine.client.get("/model_info")["weight_version"])
        convert(
            str(next((run_dir / "checkpoints").glob("step_*"))), str(converted)
        )  # a megatron dist checkpoint
        prompts, _, original = sync_batch
        for i, hf_dir in enumerate((final, converted)):  # SGLang's own loader reads the directory ...
            version = steps + 2 * i + 1
            load_weights(engine, engine.model_path, version)  # ... over the original weights, which it serves
            _assert_serves(engine, prompts, original)
            engine.begin_weight_update(version + 1)
            engine.update_weights_from_disk(str(hf_dir), version + 1)
            engine.end_weight_update(version + 1)
            want = _generate(HFRolloutEngine(str(hf_dir)), prompts)
            assert _moved(want, original) > 1e-3  # the run's three steps changed what the prompts get
            _assert_serves(engine, prompts, want, version + 1)
    finally:
        load_weights(engine, engine.model_path, steps + 5)  # later tests see the original
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0 for r in rows), rows
    assert served == steps, f"the server serves weight version {served} after {steps} synced steps"
    assert all(0 <= r["staleness/mean"] <= r["staleness/max"] <= 1 for r in rows), [
        r["staleness/max"] for r in rows
    ]
    whole, trained, again = (load_hf_weights(d) for d in (engine.model_path, final, converted))
    assert set(trained) == set(whole) == set(again), (
        set(trained) ^ set(whole),
        set(again) ^ set(whole),
    )  # as released
    assert all(torch.equal(trained[n], again[n]) for n in trained)
    assert any(not torch.equal(trained[n], whole[n]) for n in whole)
