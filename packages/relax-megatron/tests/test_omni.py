"""Media models on the megatron trainer (omni.py, TP=1 in-process gloo): Qwen2.5-VL, Qwen3-VL and the
Qwen2.5-Omni thinker score image, video (and audio) prompts as transformers does (core's torch trainer,
fp32), export the checkpoint's HF weights bit-exactly, take the torch trainer's policy-gradient step and
resume it from a dist checkpoint; unsupported families and layouts are refused by name. TP=2 and PP=2:
test_tensor_parallel.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from relax.core.testing import torch_trainer
from relax.core.testing.trainer import exported as _exported

KW = {"lr": 1e-2, "micro_batch_size": 3, "eps": 1e-4}


def exported(trainer) -> dict:
    """The trainer's export, MoE experts (Qwen3-Omni) fused as transformers holds them in memory (what the
    torch trainer exports; the megatron trainer exports one tensor per expert, as checkpoints and SGLang
    name them)."""
    out = _exported(trainer)
    for up in [n for n in out if n.endswith(".0.up_proj.weight") and ".mlp.experts." in n]:
        layer = up[: -len("0.up_proj.weight")]
        count = sum(1 for n in out if n.startswith(layer) and n.endswith(".down_proj.weight"))
        experts = range(count)
        out[layer + "gate_up_proj"] = torch.stack(
            [
                torch.cat([out.pop(f"{layer}{j}.gate_proj.weight"), out.pop(f"{layer}{j}.up_proj.weight")])
                for j in experts
            ]
        )
        out[layer + "down_proj"] = torch.stack([out.pop(f"{layer}{j}.down_proj.weight") for j in experts])
    return out


#: megatron's logprobs against another implementation's (transformers' in the torch trainer) on a media model:
#: float32's default (1e-5 + 1.3e-6 x |logprob|). The two sum in different orders (fused qkv, the towers' patch
#: merger), and which order a kernel takes depends on the CPU (AVX2 / AVX-512) and torch's thread count: ~3 nats
#: came out 1.03e-5 apart with 2 threads. Checks of one implementation against itself (a resumed trainer) keep 1e-6.
MATCH = {"atol": 1e-5, "rtol": 1.3e-6}


def megatron_trainer(model_dir: str, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), **{**KW, **kw})


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni"])
def family(request, tmp_path_factory, vl_batch):
    """(model_dir, media batch) of one tiny VL / Omni family (Omni: audio rows too)."""
    from relax.omni.tiny_models import OMNI_FAMILIES, tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), request.param)
    return model_dir, vl_batch(model_dir, audio=request.param in OMNI_FAMILIES)


def test_logprobs_and_export_match_transformers(megatron_world, family):
    """Image, video, image+video and text rows: logprobs equal the torch trainer's (transformers') within
    1e-5; the export is the HF model's state dict, name for name and bit for bit (LM and towers)."""
    from relax.core.data_multimodal import has_media

    model_dir, batch = family
    assert has_media(batch) and batch["attention_mask"][:, 0].min() == 0  # media, and left padding to undo
    ref, meg = torch_trainer(model_dir, **KW), megatron_trainer(model_dir)
    want = ref.forward_logprobs(batch)
    got = meg.forward_logprobs(batch)
    assert float(want.abs().sum()) > 1.0
    torch.testing.assert_close(got, want, **MATCH)
    mine, theirs = exported(meg), exported(ref)
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), name


def test_one_step_matches_the_torch_trainer(megatron_world, family):
    """One policy-gradient step (towers trainable): the same loss, grad norm and updated weights, towers included."""
    model_dir, batch = family
    ref, meg = torch_trainer(model_dir, **KW), megatron_trainer(model_dir)
    old = ref.forward_logprobs(batch)
    m_ref, m_meg = (
        ref.train_step({**batch, "old_logprobs": old}),
        meg.train_step({**batch, "old_logprobs": old}),
    )
    for key in ("loss", "entropy", "grad_norm"):
        assert m_meg[key] == pytest.approx(m_ref[key], abs=1e-5), key
    want, got = exported(ref), exported(meg)
    before = exported(torch_trainer(model_dir))
    tower = [n for n in want if ".visual." in n]
    assert tower and max(float((want[n] - before[n]).abs().max()) for n in tower) > 1e-3  # the towers trained
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():  # AdamW's first step: 2e-4, as test_trainer.py
        torch.testing.assert_close(got[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_unsupported_media_layouts_are_refused_by_name():
    from types import SimpleNamespace

    from relax.megatron.media_front import check_supported

    with pytest.raises(
        ValueError, match="model_type 'qwen3_vl_moe': its model adapter declares no megatron media"
    ):
        check_supported(SimpleNamespace(model_type="qwen3_vl_moe"))
    with pytest.raises(ValueError, match="distributed_optimizer is not supported for media models yet"):
        check_supported(SimpleNamespace(model_type="qwen3_vl"), distributed_optimizer=True)


def test_bf16_media_training_keeps_fp32_masters_of_the_towers_and_resumes(megatron_world, omni_moe, tmp_path):
    """bf16 on a media model (the Qwen3-Omni thinker: MoE and both towers): the towers run and are stored in bf16
    with fp32 masters, as megatron's own weights are (precision.py); the logprobs are core's torch trainer's in
    bf16 within 0.05 (each is 0.24 from fp32 on this tiny random model: measured 0.017 apart); after a step every trained tower weight's master moved by the fp32 trainer's update; a dist
    checkpoint resumes the masters themselves (the same second step, not one from their bf16 rounding)."""
    model_dir, batch = omni_moe
    fp32, bf16 = megatron_trainer(model_dir), megatron_trainer(model_dir, dtype="bfloat16")
    towers = list(bf16.front.tower_parameters())
    assert towers and all(p.dtype == torch.bfloat16 for _, p in towers)
    reference = torch_trainer(model_dir, dtype="bfloat16", trainable=False, **KW).forward_logprobs(batch)
    gap = (bf16.forward_logprobs(batch) - reference).abs().max().item()
    assert gap < 0.05, gap
    before = {n: bf16.masters.master_of(p).detach().clone() for n, p in towers}
    fp32.train_step(batch), bf16.train_step(batch)
    want, steps, ref = dict(fp32.front.tower_parameters()), [], []
    for name, param in towers:
        master = bf16.masters.master_of(param)
        assert master.dtype == torch.float32 and not torch.equal(master, before[name]), name
        steps.append((master - before[name]).flatten())
        ref.append((want[name].detach() - before[name].to(want[name].dtype)).flatten())
    cosine = torch.nn.functional.cosine_similarity(torch.cat(steps), torch.cat(ref), dim=0).item()
    print(f"bf16 vs fp32 tower update cosine {cosine:.4f}")
    assert cosine > 0.9, cosine  # the fp32 trainer's update, up to bf16 forward rounding
    bf16.save(str(tmp_path / "ckpt"))
    second = bf16.train_step(batch)
    resumed = megatron_trainer(model_dir, dtype="bfloat16")
    resumed.load(str(tmp_path / "ckpt"))
    again = resumed.train_step(batch)
    for key in ("loss", "grad_norm"):
        assert again[key] == pytest.approx(second[key], abs=1e-6), key
    for (name, param), (_, other) in zip(
        bf16.front.tower_parameters(), resumed.front.tower_parameters(), strict=True
    ):
        assert torch.equal(bf16.masters.master_of(param), resumed.masters.master_of(other)), name


def test_mrope_frequency_axes_follow_hf():
    """Chunked (Qwen2.5-VL) and interleaved (Qwen3-VL) frequency -> (T, H, W) axis maps, as HF applies them."""
    from relax.megatron.media_front import frequency_axes

    assert frequency_axes((2, 3, 3), False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert frequency_axes((2, 3, 3), True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_axes((24, 20, 20), True)[:6].tolist() == [0, 1, 2, 0, 1, 2]
    assert frequency_axes((24, 20, 20), True)[60:].tolist() == [0, 0, 0, 0]


def test_checkpoint_resumes_towers_and_save_hf_loads_in_transformers(megatron_world, family, tmp_path):
    """A dist checkpoint after one step holds the towers and their Adam state next to megatron's weights: a
        fresh trainer resumes to the same logprobs and second step; ``save_hf`` writes the whole model (processor
        included), which core's torch trainer loads to the same logprobs; so does ``relax convert`` of the dist
    checkpoint (the same files and names; the checkpoint's logprobs)."""
    model_dir, batch = family
    meg = megatron_trainer(model_dir)
    meg.train_step(batch)
    meg.save(str(tmp_path / "ckpt"))
    after, second = meg.forward_logprobs(batch), meg.train_step(batch)
    resumed = megatron_trainer(model_dir)
    resumed.load(str(tmp_path / "ckpt"))
    torch.testing.assert_close(resumed.forward_logprobs(batch), after, atol=1e-6, rtol=0)
    again = resumed.train_step(batch)
    for key in ("loss", "grad_norm"):
        assert again[key] == pytest.approx(second[key], abs=1e-6), key
    want, got = exported(meg), exported(resumed)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    meg.save_hf(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "preprocessor_config.json").is_file() or (
        tmp_path / "hf" / "processor_config.json"
    ).is_file()
    torch.testing.assert_close(
        torch_trainer(str(tmp_path / "hf"), **KW).forward_logprobs(batch),
        meg.forward_logprobs(batch),
        **MATCH,
    )
    # relax convert: the dist checkpoint alone -> the same directory save_hf writes, at the checkpoint's weights
    from safetensors import safe_open

    from relax.megatron.checkpoint import to_hf

    names = to_hf(str(tmp_path / "ckpt"), str(tmp_path / "converted"))
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert names == sorted(f.keys()) and any(
            ".visual." in n for n in names
        )  # the full HF names, towers included
    files = {d: sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("converted", "hf")}
    assert files["converted"] == files["hf"]  # config, safetensors, tokenizer and processor files
    torch.testing.assert_close(
        torch_trainer(str(tmp_path / "converted"), **KW).forward_logprobs(batch), after, **MATCH
    )


def test_a_checkpoint_keeps_each_parameters_adam_step(megatron_world, omni_moe, vl_batch, tmp_path):
    """AdamW skips a parameter without a gradient (the audio tower on a mini-batch without audio), so parameters
    stand at different steps: the checkpoint keeps each one's (it refused to save before), and a resumed trainer
    takes the same next step. Loaded with the whole Qwen3-Omni checkpoint it comes in (the thinker inside)."""
    from relax.omni.tiny_models import wrap_whole_omni

    model_dir, with_audio = omni_moe
    whole = wrap_whole_omni(model_dir, tmp_path / "whole", "qwen3_omni")
    meg = megatron_trainer(whole)
    meg.train_step(vl_batch(model_dir))  # images and video only: no gradient reaches the audio tower
    meg.train_step(with_audio)
    steps = {float(s["step"]) for s in meg.optimizer.state.values()}
    assert steps == {1.0, 2.0}, steps
    meg.save(str(tmp_path / "ckpt"))
    second = meg.train_step(with_audio)
    resumed = megatron_trainer(whole)
    resumed.load(str(tmp_path / "ckpt"))

    def by_param(t):
        return [float(t.optimizer.state[p]["step"]) for g in t.optimizer.param_groups for p in g["params"]]

    assert by_param(resumed) == [s - 1 for s in by_param(meg)]
    again = resumed.train_step(with_audio)
    for key in ("loss", "grad_norm"):
        assert again[key] == pytest.approx(second[key], abs=1e-6), key
    want, got = exported(meg), exported(resumed)
    for (
        name,
        tensor,
    ) in want.items():  # a tower resumed at the wrong step would take another bias-corrected step
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("tp", [1, 2])
def test_lm_round_trip_is_bit_exact_with_a_padded_vocabulary(tmp_path_factory, tp):
    """Qwen2.5-VL's LM (q/k/v biases, vocabulary 71): HF -> megatron TP shards (rows zero-padded to a multiple
    of TP) -> HF is the identity."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from relax.megatron import convert, media_front
    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    config = media_front.lm_config(AutoConfig.from_pretrained(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    hf = media_front.lm_state(model.state_dict(), media_front.hooks(model.config).lm_prefix)
    shards = convert.hf_to_megatron(hf, config, tp)
    assert config.vocab_size == 71 and shards[0]["embedding.word_embeddings.weight"].shape[0] == -(-71 // tp)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in shards[0]
    back = convert.megatron_to_hf(shards, config)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="use_audio_in_video needs ffmpeg")
@pytest.mark.parametrize("omni_family", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_in_video_matches_transformers(megatron_world, tmp_path_factory, omni_family):
    """A video whose soundtrack is interleaved with its frames (``use_audio_in_video``; two rows of different
    lengths, so one is left-padded): the Omni thinkers' logprobs equal the torch trainer's (the adapter hands
    the flag to HF's rope index on both sides; relax-omni's test_audio_in_video shows the flag matters)."""
    from relax.core.context import PluginContext
    from relax.core.data import Sample, collate
    from relax.omni import synthetic
    from relax.omni.adapters import AUDIO_IN_VIDEO
    from relax.omni.processors import OmniProcessorParams, make_factory
    from relax.omni.tiny_models import tiny_multimodal_dir

    root = tmp_path_factory.mktemp("aiv")
    synthetic.moving_dot_video(root / "dot_sound.mp4", right=False, tone_hz=330.0)
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), omni_family)
    params = OmniProcessorParams(
        min_pixels=56 * 56,
        max_pixels=112 * 112,
        video_min_pixels=28 * 28,
        video_max_pixels=56 * 56,
        max_frames=4,
        use_audio_in_video=True,
    )
    proc = make_factory(omni_family)(params, PluginContext(role="processor", model_path=model_dir))
    processed = [
        proc.process(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": str(root / "dot_sound.mp4")},
                        {"type": "text", "text": text},
                    ],
                }
            ],
            [],
            f"row {i}",
        )
        for i, text in enumerate(["which way?", "which way does it go?"])
    ]
    assert all(p["inputs"][AUDIO_IN_VIDEO].tolist() == [1] for p in processed)
    answer = proc.tokenizer.encode("left 2")
    samples = [
        Sample(prompt_ids=list(p["prompt_ids"]), group_id=i, response_ids=answer, mm_inputs=p["inputs"])
        for i, p in enumerate(processed)
    ]
    batch = collate(samples, pad_id=0)
    assert batch["attention_mask"][:, 0].min() == 0  # left padding to undo
    want = torch_trainer(model_dir, **KW).forward_logprobs(batch)
    torch.testing.assert_close(megatron_trainer(model_dir).forward_logprobs(batch), want, **MATCH)


def test_frozen_towers_are_neither_trained_nor_exported(megatron_world, family):
    """``freeze_media_towers``: the step leaves the towers as loaded (save_hf still writes them), the export
    holds the language model only."""
    model_dir, batch = family
    meg = megatron_trainer(model_dir, freeze_media_towers=True)
    towers = {n: p.detach().clone() for n, p in meg.front.tower_parameters()}
    assert towers and not any(p.requires_grad for _, p in meg.front.tower_parameters())
    meg.train_step(batch)
    assert all(torch.equal(p, towers[n]) for n, p in meg.front.tower_parameters())
    names = set(exported(meg))
    assert (
        names
        and not names & set(towers)
        and all(n.startswith(("model.language_model.", "lm_head.")) for n in names)
    )


TOWERS = {"vision": "model.visual.", "audio": "model.audio_tower."}  # the in-memory HF names of each kind


@pytest.mark.parametrize("kind", ["vision", "audio"])
def test_one_kind_of_tower_frozen_is_neither_trained_nor_exported(
    megatron_world, kind, vl_batch, tmp_path_factory, tmp_path
):
    """``freeze_vision`` / ``freeze_audio`` on the Qwen2.5-Omni thinker: the step leaves that tower as loaded,
    the export leaves it out and ``save_hf`` still writes it; the other tower trains and is exported."""
    from safetensors.torch import load_file

    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_omni")
    meg = megatron_trainer(model_dir, **{f"freeze_{kind}": True})
    frozen, other = TOWERS[kind], TOWERS["audio" if kind == "vision" else "vision"]
    loaded = {n: p.detach().clone() for n, p in meg.front.tower_parameters()}
    locked = {n for n, p in meg.front.tower_parameters() if not p.requires_grad}
    assert locked and locked == {n for n in loaded if n.startswith(frozen)}
    meg.train_step(vl_batch(model_dir, audio=True))
    now = dict(meg.front.tower_parameters())
    assert all(torch.equal(now[n], loaded[n]) for n in locked), f"the frozen {kind} tower changed"
    assert any(not torch.equal(now[n], loaded[n]) for n in loaded if n.startswith(other)), (
        f"{other}* not trained"
    )
    names = set(exported(meg))
    assert not names & locked and {n for n in names if n.startswith(other)} == {
        n for n in loaded if n.startswith(other)
    }
    meg.save_hf(str(tmp_path / "hf"))
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(saved) == names | locked and all(torch.equal(saved[n], loaded[n]) for n in locked)


def test_a_freeze_switch_for_a_tower_the_model_lacks_names_the_field(
    megatron_world, tmp_path_factory, tiny_qwen3
):
    """``freeze_audio`` on a VL model, ``freeze_vision`` on a text model: the wrong model for the run, refused
    naming the field; ``freeze_media_towers`` on a text model freezes nothing, as before."""
    from relax.omni.tiny_models import tiny_multimodal_dir

    vl_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    with pytest.raises(
        ValueError, match=r"freeze_audio: true, but the model \(model_type 'qwen2_5_vl'\) has no audio"
    ):
        megatron_trainer(vl_dir, freeze_audio=True)
    with pytest.raises(
        ValueError, match=r"freeze_vision: true, but the model \(model_type 'qwen3'\) has no vision"
    ):
        megatron_trainer(tiny_qwen3[0], freeze_vision=True)
    assert megatron_trainer(tiny_qwen3[0], freeze_media_towers=True).front is None
