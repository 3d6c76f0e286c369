"""One in-process gloo world of size 1 with megatron's parallel state (TP=1, PP=1) per test module.

Module-scoped, not package-scoped: without an ``__init__.py`` pytest would keep a "package" fixture for the
whole session. Torn down (process group destroyed, CPU patches removed) after each module, so the rest of
a full pytest run sees an untouched torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # without it a megatron step is ~25x slower on CPU


def _world(tmp_path_factory, backend: str):
    """``torch.distributed`` (``backend``, world size 1; NCCL on cuda:0) + megatron parallel state, TP=1, PP=1."""
    import torch

    from relax.megatron.parallel import world_of_one

    if backend == "nccl":
        torch.cuda.set_device(0)
    with world_of_one(str(tmp_path_factory.mktemp(backend) / "store"), backend):
        yield


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """The CPU world: gloo."""
    yield from _world(tmp_path_factory, "gloo")


@pytest.fixture(scope="module")
def cuda_world(tmp_path_factory):
    """The GPU world (test_gpu.py): NCCL on cuda:0."""
    yield from _world(tmp_path_factory, "nccl")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(model_dir, HF config, HF state dict) of the conformance kit's tiny Qwen3 (built locally)."""
    from transformers import AutoConfig

    from relax.core.testing.models import load_hf_weights, tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("models"))
    return model_dir, AutoConfig.from_pretrained(model_dir), load_hf_weights(model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory, tiny_qwen3):
    """(model_dir, HF config, HF state dict) of a seeded tiny Qwen3-MoE (4 experts, top 2, renormalised
    as in the released Qwen3-MoE configs) with the tiny Qwen3's tokenizer, saved as transformers writes
    it (one tensor per expert)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax.core.testing.models import load_hf_weights

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    config = Qwen3MoeConfig(
        pad_token_id=tokenizer.pad_token_id,
        vocab_size=24,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    model_dir = tmp_path_factory.mktemp("moe") / "qwen3-moe"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir), AutoConfig.from_pretrained(model_dir), load_hf_weights(str(model_dir))


@pytest.fixture(scope="session")
def fuse_experts():
    """``fuse(weights, config)``: an export's per-expert HF names (as checkpoints and SGLang name them) as
    transformers' in-memory fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (what core's torch trainer
    exports for Qwen3-MoE); a new dict."""
    import torch

    def fuse(weights: dict, config) -> dict:
        out = dict(weights)
        for i in range(config.num_hidden_layers):
            e = f"model.layers.{i}.mlp.experts."
            experts = range(config.num_experts)
            out[e + "gate_up_proj"] = torch.stack(
                [
                    torch.cat([out.pop(f"{e}{j}.gate_proj.weight"), out.pop(f"{e}{j}.up_proj.weight")])
                    for j in experts
                ]
            )
            out[e + "down_proj"] = torch.stack([out.pop(f"{e}{j}.down_proj.weight") for j in experts])
        return out

    return fuse


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def run_ranks(tmp_path_factory):
    """``run(mode, model_dir, data, *extra, world=2, expect_ok=True, script="tp_worker.py")``: ``script``
    as ``world`` processes on ``data``; rank 0's results, or with ``expect_ok=False`` the ranks' combined
    output."""

    def run(
        mode: str,
        model_dir: str,
        data,
        *extra: str,
        world: int = 2,
        expect_ok: bool = True,
        script: str = "tp_worker.py",
    ):
        import torch

        tmp_path = tmp_path_factory.mktemp(mode)
        torch.save(data, tmp_path / f"{mode}-input.pt")
        out = tmp_path / f"{mode}-out.pt"
        cmd = [
            sys.executable,
            str(Path(__file__).with_name(script)),
            "--mode",
            mode,
            "--world",
            str(world),
            "--port",
            str(_free_port()),
            "--model-dir",
            model_dir,
            "--input",
            str(tmp_path / f"{mode}-input.pt"),
            "--out",
            str(out),
            *extra,
        ]
        procs = [
            subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(world)
        ]
        try:
            logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                p.kill()
        ok = all(p.returncode == 0 for p in procs)
        if not expect_ok:
            assert not ok, f"{mode} with {extra} succeeded, expected a failure"
            return "\n".join(logs)
        assert ok, "a rank failed:\n" + "\n---\n".join(log[-3000:] for log in logs)
        return torch.load(out)

    return run


# ---------------------------------------------------------------- MoE routing replay (test_routing_replay.py)
R3_KW = {"lr": 1e-2, "eps": 1e-4, "micro_batch_size": 4}  # every routing-replay trainer (torch and megatron)


@pytest.fixture(scope="session")
def r3_perturbed_dir(tiny_qwen3_moe, tmp_path_factory):
    """The tiny Qwen3-MoE with seeded noise (0.1 of each weight's std) on every router, saved with its tokenizer:
    the trainers' weights after a sync in another precision, say; enough to move some tokens to other experts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.routing_replay import moe_routers

    model_dir = tiny_qwen3_moe[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(0.1 * router.weight.std() * torch.randn(router.weight.shape, generator=gen))
    target = tmp_path_factory.mktemp("r3") / "perturbed"
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    return str(target)


@pytest.fixture(scope="session")
def r3_batch(tiny_qwen3_moe):
    """A left-padded batch whose samples carry the unperturbed model's routing (recorded by core's
    ``RoutingRecorder`` on each unpadded sequence, as the engine runs it; the last token unrecorded, as the
    engine leaves it) and logprobs, collated as the controller does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.routing_replay import UNRECORDED, RoutingRecorder
    from relax.core.testing import make_batch, make_samples

    model_dir = tiny_qwen3_moe[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = make_samples(tokenizer, rows=8, seed=3)
    recorder = RoutingRecorder(model)
    try:
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
            s.rollout_logprobs = (
                torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids) :, None])[:, 0].tolist()
            )
            s.routed_experts = recorder.take(1, ids.shape[1])[0]
            s.routed_experts[-1] = UNRECORDED
    finally:
        recorder.close()
    return make_batch(samples, tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def r3_torch(r3_perturbed_dir, r3_batch):
    """Core's torch trainer on the perturbed model: logprobs with its own routing ("free") and replaying the
    batch's ("replayed"), then a replayed step ("metrics", exported "weights")."""
    from relax.core.testing import torch_trainer
    from relax.core.testing.trainer import exported

    ref = torch_trainer(r3_perturbed_dir, routing_replay=True, **R3_KW)
    free = ref.forward_logprobs({k: v for k, v in r3_batch.items() if k != "routed_experts"})
    replayed = ref.forward_logprobs(r3_batch)
    return {"free": free, "replayed": replayed, "metrics": ref.train_step(r3_batch), "weights": exported(ref)}


@pytest.fixture(scope="session")
def assert_r3_step(tiny_qwen3_moe, r3_torch, fuse_experts):
    """``check(got)``: a megatron trainer's replayed step (``{"metrics", "weights"}``) is the torch trainer's:
    loss, grad norm, routing metrics and (EP-gathered, HF-named) updated weights."""
    import torch

    def check(got: dict) -> None:
        for key in ("loss", "grad_norm", "routing/logprob_diff_replay", "routing/logprob_diff_free"):
            assert got["metrics"][key] == pytest.approx(r3_torch["metrics"][key], abs=1e-5), key
        for key in ("routing/mismatch_frac_replay", "routing/mismatch_frac_free"):
            assert got["metrics"][key] == pytest.approx(r3_torch["metrics"][key], abs=1e-9), key
        mine, want = fuse_experts(got["weights"], tiny_qwen3_moe[1]), r3_torch["weights"]
        assert sorted(mine) == sorted(want)
        for name, tensor in want.items():  # AdamW's first step: 2e-4, as test_trainer.py
            torch.testing.assert_close(
                mine[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )

    return check


# ---------------------------------------------------------------- media models (test_omni.py, test_tensor_parallel.py)
@pytest.fixture(scope="session")
def media_files(tmp_path_factory):
    """A 60x80 PNG and a 4-frame 56x56 video (``.npy``) of seeded noise."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(root / "img.png")
    np.save(root / "vid.npy", (rng.random((4, 56, 56, 3)) * 255).astype("uint8"))
    np.save(root / "tone.npy", np.sin(np.arange(8000) * 0.05).astype("float32"))  # 0.5 s at 16 kHz
    return {
        "image": str(root / "img.png"),
        "video": f"file://{root / 'vid.npy'}",
        "audio": str(root / "tone.npy"),
    }


def media_batch(model_dir: str, files: dict[str, str], audio: bool = False) -> dict:
    """Six left-padded rows: image, video, text only, image + video, then image, video or (``audio``: an Omni
    model) audio, audio + image (micro-batches of 3 mix media and text rows; prompts of different lengths),
    with advantages of both signs."""
    import torch

    from relax.core.data import Sample, collate
    from relax.core.testing.multimodal_processor import TinyMediaProcessor

    image, video = {"type": "image", "image": files["image"]}, {"type": "video", "video": files["video"]}
    contents = [
        [image, {"type": "text", "text": "what?"}],
        [video, {"type": "text", "text": "where is it?"}],
        "no media here?",
        [image, video, {"type": "text", "text": "same?"}],
    ]
    sound = {"type": "audio", "audio": files["audio"]}
    contents += [
        [sound, {"type": "text", "text": "heard?"}],
        [image, sound, {"type": "text", "text": "both?"}],
    ]
    processor = TinyMediaProcessor(model_dir)
    processed = [
        processor.process([{"role": "user", "content": contents[i]}], [], f"row {i}")
        for i in ((0, 1, 2, 3, 4, 5) if audio else (0, 1, 2, 3, 0, 1))
    ]
    answer = processor.hf.tokenizer.encode("it is a small picture of nothing much")
    samples = [
        Sample(
            prompt_ids=list(p["prompt_ids"]),
            group_id=i,
            response_ids=answer[i : i + 3 + i % 2],
            mm_inputs=p["inputs"],
        )
        for i, p in enumerate(processed)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.where(torch.arange(6)[:, None] % 2 == 0, 1.0, -0.5) * batch["response_mask"]
    return batch


@pytest.fixture(scope="session")
def vl_batch(media_files):
    """``batch(model_dir)``: :func:`media_batch` of a VL model on the session's media files."""
    return lambda model_dir, audio=False: media_batch(model_dir, media_files, audio)


@pytest.fixture(scope="session")
def vl_models(tmp_path_factory, vl_batch):
    """family -> (model_dir, media batch) of the tiny Qwen2.5-VL and Qwen3-VL (vocabulary 71: at TP=2 megatron
    pads it to 72, convert.Dims.padded_vocab)."""
    from relax.omni.tiny_models import tiny_multimodal_dir

    dirs = {f: tiny_multimodal_dir(tmp_path_factory.getbasetemp(), f) for f in ("qwen2_5_vl", "qwen3_vl")}
    return {f: (d, vl_batch(d)) for f, d in dirs.items()}


@pytest.fixture(scope="session")
def omni_moe(tmp_path_factory, vl_batch):
    """(model_dir, media batch with audio rows) of the tiny Qwen3-Omni (MoE) thinker."""
    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen3_omni")
    return model_dir, vl_batch(model_dir, audio=True)


def _logprobs_match_transformers(model_dir: str, config, hf: dict) -> None:
    """A TP=1 megatron-core model loaded from ``hf`` gives transformers' per-token logprobs within fp32's
    tolerance on random tokens (which spread enough for the comparison to mean something)."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax.megatron import convert, gpt_model

    model = gpt_model.build_gpt_model(config)
    convert.load_hf_into(model, hf, config)
    model.eval()
    tokens = torch.randint(0, config.vocab_size, (3, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)
    with torch.no_grad():
        logprobs = -model(inputs, positions, attention_mask=None, labels=targets)
        ref_logits = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(inputs).logits
        )
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    assert ref.std() > 0.1
    torch.testing.assert_close(logprobs, ref, rtol=1.3e-6, atol=1e-5)


@pytest.fixture
def logprobs_match_transformers():
    """``check(model_dir, config, hf)``: megatron's TP=1 logprobs equal transformers' (needs ``megatron_world``)."""
    return _logprobs_match_transformers


# ---------------------------------------------- checks against core's torch trainer (multi-process tests)
#: a media model's logprobs at TP=2 / PP=2 against the torch trainer's (transformers'): float32's default
#: (1e-5 + 1.3e-6 x |logprob|), as test_tp2_logprobs_entropy_and_export_match_hf. The ranks sum in another order
#: (row-parallel partial sums, sharded towers) and the order a kernel takes depends on the CPU: on an AVX-512
#: machine Qwen2.5-VL at TP=2 came out 1.097e-5 apart on a ~3 nat logprob (1e-5 alone passed elsewhere).
MATCH = {"atol": 1e-5, "rtol": 1.3e-6}


def _odd_width(batch: dict, pad_id: int = 0) -> dict:
    """``batch`` with one more left-padding column (an odd sequence length: sequence parallelism at TP=2 pads
    it to a multiple of 2), without ``old_logprobs`` (each model scores its own)."""
    import torch

    out = {k: v for k, v in batch.items() if k != "old_logprobs"}
    for key, value in (("input_ids", pad_id), ("attention_mask", 0), ("position_ids", 0)):
        out[key] = torch.cat([torch.full_like(batch[key][:, :1], value), batch[key]], 1)
    assert out["input_ids"].shape[1] % 2 == 1
    return out


def _stepped_reference(got: dict, ref, batch: dict) -> dict:
    """Step core's torch trainer ``ref`` on ``batch``: ``got``'s step metrics must be its; returns its exported
    weights after the step."""
    from relax.core.testing.trainer import exported

    metrics = ref.train_step(batch)
    for key in ("loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    return exported(ref)


def _media_step_reference(got: dict, model_dir: str, batch: dict) -> dict:
    """The torch trainer on ``batch``: ``got``'s logprobs and step metrics must be its; returns its
    exported weights after the step."""
    import torch

    from relax.core.testing import torch_trainer

    ref = torch_trainer(model_dir, lr=1e-2, eps=1e-4, micro_batch_size=3)
    torch.testing.assert_close(got["logprobs"], ref.forward_logprobs(batch), **MATCH)
    return _stepped_reference(got, ref, batch)


def _assert_same_weights(mine: dict, want: dict) -> None:
    import torch

    assert sorted(mine) == sorted(want)
    for name, tensor in want.items():  # AdamW's first step: 2e-4, as test_trainer.py
        torch.testing.assert_close(mine[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _assert_same_step(got: dict, ref, batch: dict) -> None:
    """``got`` (a multi-process trainer's step) has the loss, entropy, grad norm and gathered updated
    weights of core's torch trainer ``ref`` stepping on ``batch``."""
    import torch

    want = _stepped_reference(got, ref, batch)
    assert sorted(got["weights"]) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(
            got["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def _fused(weights: dict) -> dict:
    """An export's per-expert weights fused as transformers holds them in memory (what the torch trainer exports)."""
    import torch

    mine = dict(weights)
    for down in [n for n in mine if n.endswith(".mlp.experts.0.down_proj.weight")]:
        layer = down[: -len("0.down_proj.weight")]
        experts = range(sum(1 for n in mine if n.startswith(layer) and n.endswith(".down_proj.weight")))
        mine[layer + "gate_up_proj"] = torch.stack(
            [
                torch.cat([mine.pop(f"{layer}{j}.gate_proj.weight"), mine.pop(f"{layer}{j}.up_proj.weight")])
                for j in experts
            ]
        )
        mine[layer + "down_proj"] = torch.stack([mine.pop(f"{layer}{j}.down_proj.weight") for j in experts])
    return mine


@pytest.fixture(scope="session")
def torch_step():
    """The multi-process tests' checks against core's torch trainer: ``match`` (a media model's logprob
    tolerance), ``odd_width``, ``stepped_reference`` / ``media_step_reference`` (step the torch trainer, check
    ``got``'s metrics, return its weights), ``assert_same_step``, ``assert_same_weights`` and ``fused``."""
    from types import SimpleNamespace

    return SimpleNamespace(
        match=MATCH,
        odd_width=_odd_width,
        stepped_reference=_stepped_reference,
        media_step_reference=_media_step_reference,
        assert_same_step=_assert_same_step,
        assert_same_weights=_assert_same_weights,
        fused=_fused,
    )


@pytest.fixture(scope="module")
def moe_tp_batch(tiny_qwen3):
    """The TP=2 MoE checks' batch: the tiny Qwen3's eight sample rows at an odd width."""
    from transformers import AutoTokenizer

    from relax.core.testing import make_batch, make_samples

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    return _odd_width(make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id))


@pytest.fixture(scope="module")
def omni_moe_tp(omni_moe):
    """(model_dir, media batch of odd width) of the tiny Qwen3-Omni (MoE) thinker, for TP=2."""
    return omni_moe[0], _odd_width(omni_moe[1])
