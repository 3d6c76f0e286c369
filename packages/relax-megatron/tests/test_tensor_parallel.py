"""TP=2, PP=2, DP=2 and MoE EP=2 on CPU: two real processes over gloo (``tp_worker.py``), one launch.

Vocab-parallel logprobs and entropy equal transformers' (no full-logit gather: each rank holds half the
vocabulary), TP-gathered weights map back to the HF checkpoint bit-exactly, a TP=2 train step matches
core's torch trainer, PP=2 logprobs equal transformers' and PP=2, DP=2 and (MoE) DP=2 x EP=2 train steps
match the torch trainer (with MoE routing replay too, at DP=2 x EP=2 and PP=2); TP=2, PP=2 and DP=2 dist
checkpoints load in one process. Qwen3-MoE and the Qwen3-Omni (MoE) thinker at TP=2 run with sequence
parallelism and match transformers / the torch trainer too."""

from __future__ import annotations

import pytest
import torch

TOKENS = torch.randint(0, 24, (2, 25), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def torch_reference(tiny_qwen3):
    """Core's torch trainer on the same model and a batch with its old logprobs (eps: see test_trainer.py)."""
    from transformers import AutoTokenizer

    from relax.core.testing import make_batch, make_samples, torch_trainer

    model_dir = tiny_qwen3[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    ref = torch_trainer(model_dir, lr=1e-2, eps=1e-4, micro_batch_size=4)
    batch["old_logprobs"] = ref.forward_logprobs(batch)
    return ref, batch


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("tp2") / "checkpoint"


PP_TOKENS = torch.randint(0, 24, (2, 25), generator=torch.Generator().manual_seed(6))


def dp_batch(batch: dict) -> dict:
    """The DP=2 checks' batch: the first 7 rows (3 + 4: the first replica gets a masked padding row)."""
    from relax.core.policy_update.batching import take_rows

    return take_rows(batch, 0, 7)


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("pp2") / "checkpoint"


@pytest.fixture(scope="module")
def launch(
    tiny_qwen3,
    tiny_qwen3_moe,
    torch_reference,
    run_ranks,
    tp2_checkpoint,
    pp2_checkpoint,
    r3_perturbed_dir,
    r3_batch,
    vl_models,
    omni_moe,
    omni_dense,
    moe_tp_batch,
    omni_moe_tp,
):
    """One two-process launch for every check below (starting processes is the slow part): TP=2 (the
    trained trainer saved to ``tp2_checkpoint``), the same ranks at EP=2 and DP=2 x EP=2 with the tiny
    Qwen3-MoE, with MoE routing replay at DP=2 x EP=2 and PP=2, the tiny VL models (Qwen2.5-VL saved to
    ``<tp2_checkpoint>-vl``) and the Qwen2.5-Omni thinker at TP=2 and the Qwen3-Omni thinker at DP=2 x EP=2, then at PP=2 (the Omni thinkers too) (saved to ``pp2_checkpoint``)
    and DP=2 (saved to ``<pp2_checkpoint>-dp``); Qwen3-MoE and the Qwen3-Omni thinker at TP=2 (sequence parallelism)."""
    data = {
        "tokens": TOKENS,
        "batch": torch_reference[1],
        "moe_dir": tiny_qwen3_moe[0],
        "routing": {"batch": r3_batch, "moe_dir": r3_perturbed_dir},
        "omni": vl_models,
        "omni_moe": omni_moe,
        "omni_tp": {"qwen2_5_omni": omni_dense},
        "omni_ckpt": {"qwen2_5_vl": str(tp2_checkpoint) + "-vl"},
        "omni_thinkers": {"qwen2_5_omni": omni_dense, "qwen3_omni": omni_moe},
        "moe_tp": (tiny_qwen3_moe[0], moe_tp_batch, str(tp2_checkpoint) + "-moe"),
        "omni_moe_tp": omni_moe_tp,
        "pipeline": {
            "tokens": PP_TOKENS,
            "ckpt": str(pp2_checkpoint),
            "dp_batch": dp_batch(torch_reference[1]),
        },
    }
    return run_ranks("tensor", tiny_qwen3[0], data, "--ckpt", str(tp2_checkpoint))


@pytest.fixture(scope="module")
def tp2(launch):
    return launch


def test_tp2_logprobs_entropy_and_export_match_hf(tiny_qwen3, tp2):
    from transformers import AutoModelForCausalLM

    from relax.core.algorithms import entropy_from_logits

    model_dir, config, hf = tiny_qwen3
    assert config.vocab_size == 24
    tokens, got = TOKENS, tp2["convert"]
    assert got["logits_shape"][-1] == config.vocab_size // 2  # each rank scored half the vocabulary
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(inputs).logits
        )
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got["logprobs"], ref, rtol=1.3e-6, atol=1e-5)  # same tolerance as TP=1
    torch.testing.assert_close(got["entropy"], entropy_from_logits(ref_logits), rtol=1.3e-6, atol=1e-5)
    assert sorted(got["hf"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got["hf"][name], tensor), name


def test_tp2_train_step_matches_the_torch_trainer(tp2, torch_reference, torch_step):
    """Same weights, batch and objective as core's torch trainer at TP=1: the same logprobs, loss, grad
    norm (TP shards and replicated norms each counted once) and gathered updated weights."""
    ref, batch = torch_reference
    got = tp2["train"]
    torch.testing.assert_close(got["logprobs"], batch["old_logprobs"], atol=1e-5, rtol=0)
    for mine, want in zip(got["sum_pi_squared"], ref.forward_logprobs_and_sum_pi_squared(batch), strict=True):
        torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)  # vocab-parallel sum of pi^2 too
    torch_step.assert_same_step(got, ref, batch)


@pytest.fixture(scope="module")
def pp2(launch, pp2_checkpoint):
    """The launch's PP=2 part: forward-only logprobs of ``PP_TOKENS``, a ``MegatronTrainer`` step, a dist
    checkpoint save and a second step at PP=2; then the same at DP=2.
    (tokens, rank 0's results, checkpoint directory)."""
    return PP_TOKENS, launch["pipeline"], pp2_checkpoint


def test_pp2_logprobs_match_hf(tiny_qwen3, pp2):
    """PP=2 (one layer per stage, activations sent between processes by megatron's 1F1B schedule):
    the last stage's logprobs equal transformers'."""
    from transformers import AutoModelForCausalLM

    model_dir, config, _ = tiny_qwen3
    tokens, got, _ = pp2
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(inputs).logits
        )
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got["logprobs"], ref, rtol=1.3e-6, atol=1e-5)


def test_pp2_train_step_matches_the_torch_trainer(tiny_qwen3, pp2, torch_reference, torch_step):
    """The trainer at PP=2 (1F1B over 2 micro-batches, tied embedding gradients summed across the
    stages): rank 0 (first stage) gets the last stage's logprobs and metrics; the same loss, grad norm
    and PP-gathered updated weights as core's torch trainer; its checkpoint save leaves the weights as they were."""
    from relax.core.testing import torch_trainer

    batch = torch_reference[1]
    ref = torch_trainer(
        tiny_qwen3[0], lr=1e-2, eps=1e-4, micro_batch_size=4
    )  # fresh: the TP=2 test stepped the shared one
    got = pp2[1]["train"]
    torch.testing.assert_close(got["logprobs"], batch["old_logprobs"], atol=1e-5, rtol=0)
    torch_step.assert_same_step(got, ref, batch)
    torch.testing.assert_close(got["logprobs_after"], ref.forward_logprobs(batch), atol=1e-5, rtol=1e-5)


def test_tp2_checkpoint_loads_at_tp1(megatron_world, tiny_qwen3, tp2, tp2_checkpoint, torch_reference):
    """A dist checkpoint saved by the two TP=2 ranks after their step, loaded by one TP=1 trainer
    (megatron reshards): the same step and the same logprobs as the TP=2 ranks computed after saving."""
    from relax.megatron.trainer import MegatronTrainer

    _, batch = torch_reference
    trainer = MegatronTrainer(tiny_qwen3[0], micro_batch_size=4)  # with an optimizer: its state reshards too
    before = trainer.forward_logprobs(batch)
    trainer.load(str(tp2_checkpoint))
    assert trainer.update.step == 1
    after = trainer.forward_logprobs(batch)
    assert float((after - before).abs().max()) > 1e-4  # the load changed the weights
    torch.testing.assert_close(after, tp2["train"]["logprobs_after"], atol=1e-5, rtol=0)


def test_ep2_moe_logprobs_and_export_match_hf(tiny_qwen3_moe, tp2):
    """Qwen3-MoE with two experts per rank (tokens exchanged by the allgather dispatcher): logprobs equal
    transformers' within 1e-5 and the EP-gathered weights map back to the HF checkpoint bit-exactly."""
    from transformers import AutoModelForCausalLM

    model_dir, _, hf = tiny_qwen3_moe
    got = tp2["moe"]
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    with torch.no_grad():
        ref_logits = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(inputs).logits
        )
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got["logprobs"], ref, rtol=1.3e-6, atol=1e-5)
    assert sorted(got["hf"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got["hf"][name], tensor), name


def test_pp2_bf16_step_tracks_fp32(pp2):
    """PP=2 in bf16 (fp32 masters: each stage's gradients accumulate in fp32 under the 1F1B schedule,
    the tied embedding's are summed across the stages in fp32): the fp32 step's loss and grad norm within
    bf16 forward noise (each scored against its own old logprobs), and bf16 weights within one AdamW
    step (lr 1e-2: a near-zero gradient may flip its sign) plus bf16 rounding of the fp32 step's."""
    fp32, bf16 = pp2[1]["train"], pp2[1]["bf16"]
    assert bf16["metrics"]["loss"] == pytest.approx(fp32["metrics"]["loss"], abs=1e-3)
    assert bf16["metrics"]["grad_norm"] == pytest.approx(fp32["metrics"]["grad_norm"], rel=0.05)
    assert sorted(bf16["weights"]) == sorted(fp32["weights"])
    for name, tensor in fp32["weights"].items():
        assert bf16["weights"][name].dtype == (
            torch.float32 if "norm" in name else torch.bfloat16
        )  # torch norms: fp32
        torch.testing.assert_close(bf16["weights"][name].float(), tensor, atol=2.5e-2, rtol=1e-2)


def test_pp2_with_the_distributed_optimizer_builds(pp2):
    """PP=2 with ``distributed_optimizer: true`` (``calculate_per_token_loss`` once in the config, not
    twice: that was a TypeError at construction): each stage builds and megatron's DDP wraps it; on CPU
    megatron's optimizer then stops at its CUDA allocations (test_gpu.py takes the step on two GPUs)."""
    got = pp2[1]["distopt"]
    assert (got["pp"], got["per_token_loss"], got["ddp"]) == (2, True, "DistributedDataParallel")
    if not torch.cuda.is_available():
        assert "Torch not compiled with CUDA enabled" in got["optimizer_error"]
        assert "calculate_per_token_loss" not in got["optimizer_error"]


def test_dp2_train_step_matches_the_torch_trainer(tiny_qwen3, pp2, torch_reference, torch_step):
    """DP=2 (the same two processes as data-parallel replicas, 3 and 4 of 7 rows, padded to 2 micro-batches
    of 2 each; token counts, metric sums and gradients summed over the replicas): every rank gets all rows'
    logprobs, and the step has the loss, grad norm and updated weights of core's torch trainer on the whole
    batch (within 1e-5)."""
    from relax.core.testing import torch_trainer

    batch = dp_batch(torch_reference[1])
    ref = torch_trainer(tiny_qwen3[0], lr=1e-2, eps=1e-4, micro_batch_size=4)
    got = pp2[1]["dp"]
    torch.testing.assert_close(got["logprobs"], batch["old_logprobs"], atol=1e-5, rtol=0)
    torch_step.assert_same_step(got, ref, batch)


@pytest.mark.parametrize("saved_by", ["train", "dp"])
def test_pp2_and_dp2_checkpoints_resume_in_one_process(
    megatron_world, tiny_qwen3, pp2, torch_reference, saved_by
):
    """A dist checkpoint saved after their first step by the two PP=2 stages ("train") or the two DP=2
    replicas ("dp": one copy of the replicated weights and AdamW state, each replica's RNG), loaded by one
    TP=PP=DP=1 trainer (megatron maps the stages' layers onto one model): its second step repeats the
    ranks' second step (loss, grad norm and gathered weights within 1e-5)."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.testing.trainer import exported
    from relax.megatron.trainer import MegatronTrainer

    batch = dp_batch(torch_reference[1]) if saved_by == "dp" else torch_reference[1]
    got = pp2[1][saved_by]
    objective = build_policy_objective(AlgorithmConfig())
    trainer = MegatronTrainer(tiny_qwen3[0], objective=objective, lr=1e-2, eps=1e-4, micro_batch_size=4)
    trainer.load(str(pp2[2]) + ("-dp" if saved_by == "dp" else ""))
    assert trainer.update.step == 1
    torch.testing.assert_close(trainer.forward_logprobs(batch), got["logprobs_after"], atol=1e-5, rtol=0)
    metrics = trainer.train_step(batch)
    for key in ("loss", "grad_norm"):
        assert metrics[key] == pytest.approx(got["second"][key], abs=1e-5), key
    weights = exported(trainer)
    assert sorted(weights) == sorted(got["weights_second"])
    for name, tensor in got["weights_second"].items():
        torch.testing.assert_close(
            weights[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_dp2_ep2_moe_step_matches_the_torch_trainer(
    tiny_qwen3_moe, tp2, torch_reference, fuse_experts, torch_step
):
    """Qwen3-MoE at DP=2 x EP=2 (each replica its 4 rows and 2 of the 4 experts; the dispatcher brings both
    replicas' tokens to an expert, so only the non-expert gradients are summed over DP; the grad norm adds
    the EP ranks' expert norms): the old logprobs, loss, grad norm and EP-gathered updated weights of core's
    torch trainer stepping on the whole batch (within 1e-5; 2e-4 for weights as in the TP=1 MoE test)."""
    from relax.core.testing import torch_trainer

    model_dir, config, _ = tiny_qwen3_moe
    batch = {k: v for k, v in torch_reference[1].items() if k != "old_logprobs"}
    ref = torch_trainer(model_dir, lr=1e-2, eps=1e-4, micro_batch_size=4)
    got = tp2["moe_train"]
    torch.testing.assert_close(got["logprobs"], ref.forward_logprobs(batch), atol=1e-5, rtol=0)
    torch_step.assert_same_weights(
        fuse_experts(got["weights"], config), torch_step.stepped_reference(got, ref, batch)
    )


@pytest.mark.parametrize("layout", ["ep", "pp", "tp"])
def test_routing_replay_at_dp2_ep2_pp2_and_tp2_matches_the_torch_trainer(
    tp2, r3_torch, assert_r3_step, layout
):
    """MoE routing replay (test_routing_replay.py's batch and perturbed routers) at DP=2 x EP=2 (each replica
    routes its own rows before the dispatcher exchanges them; the mismatch counts summed over the world), PP=2
    (each stage replays its own layer's routing, under 1F1B) and TP=2 (sequence parallelism: each TP rank
    replays its slice of the sequence): logprobs, step and routing metrics of the torch trainer replaying the
    same routing."""
    got = tp2["routing"][layout]
    torch.testing.assert_close(got["logprobs"], r3_torch["replayed"], atol=1e-5, rtol=0)
    assert_r3_step(got)


@pytest.mark.parametrize("layout", ["omni", "omni_pp"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tp2_and_pp2_media_models_match_the_torch_trainer(tp2, vl_models, family, layout, torch_step):
    """Qwen2.5-VL (q/k/v biases sharded with their rows) and Qwen3-VL (DeepStack) at TP=2 ("omni") and PP=2
    ("omni_pp": the towers on the first stage, the rope index on both) on image, video and text rows: the
    torch trainer's logprobs, then its step (loss, grad norm, gathered weights, towers included)."""
    got = tp2[layout][family]
    want = torch_step.media_step_reference(got, *vl_models[family])
    assert any(".visual." in n for n in want)
    torch_step.assert_same_weights(got["weights"], want)


def test_relax_convert_of_a_tp2_media_checkpoint_loads_in_transformers(
    megatron_world, tp2, vl_models, tp2_checkpoint, tmp_path, torch_step
):
    """``relax convert`` of the Qwen2.5-VL dist checkpoint the TP=2 ranks saved after their step (vocabulary 71
    padded to 72 rows), in one process: an HF directory (towers and processor included) that transformers
    loads, with the logprobs the TP=2 ranks computed after saving."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from relax.core.testing import torch_trainer
    from relax.megatron.checkpoint import to_hf

    model_dir, batch = vl_models["qwen2_5_vl"]
    names = to_hf(str(tp2_checkpoint) + "-vl", str(tmp_path / "hf"))
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert (
            names == sorted(f.keys())
            and f.get_slice("model.language_model.embed_tokens.weight").get_shape()[0] == 71
        )
    assert any(".visual." in n for n in names) and (tmp_path / "hf" / "processor_config.json").is_file()
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")).__name__.startswith(
        "Qwen2_5_VL"
    )
    got = torch_trainer(str(tmp_path / "hf"), micro_batch_size=3).forward_logprobs(batch)
    torch.testing.assert_close(got, tp2["omni"]["qwen2_5_vl"]["logprobs_after"], **torch_step.match)


@pytest.fixture(scope="module")
def omni_dense(tmp_path_factory, vl_batch):
    """(model_dir, media batch with audio rows) of the tiny Qwen2.5-Omni (dense) thinker."""
    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_omni")
    return model_dir, vl_batch(model_dir, audio=True)


def test_tp2_dense_omni_thinker_matches_the_torch_trainer(tp2, omni_dense, torch_step):
    """The Qwen2.5-Omni thinker at TP=2 (audio tower and rope index replicated, q/k/v biases sharded) on
    image, video, audio and text rows: the torch trainer's logprobs. (Qwen3-Omni at TP=2: below.)"""
    from relax.core.data_multimodal import has_media
    from relax.core.testing import torch_trainer

    model_dir, batch = omni_dense
    assert has_media(batch) and "mm.input_features" in batch  # audio rows
    want = torch_trainer(model_dir, micro_batch_size=3).forward_logprobs(batch)
    assert float(want.abs().sum()) > 1.0
    torch.testing.assert_close(tp2["omni_tp"]["qwen2_5_omni"], want, **torch_step.match)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_pp2_omni_thinkers_match_the_torch_trainer(tp2, omni_dense, omni_moe, family, torch_step):
    """The Omni thinkers at PP=2: the towers on the first stage; the second computes the M-RoPE positions with
    HF's rope index from the batch's own grids and audio feature lengths (no tower runs there). Logprobs on
    image, video, audio and text rows equal the torch trainer's."""
    from relax.core.testing import torch_trainer

    model_dir, batch = {"qwen2_5_omni": omni_dense, "qwen3_omni": omni_moe}[family]
    want = torch_trainer(model_dir, micro_batch_size=3).forward_logprobs(batch)
    torch.testing.assert_close(tp2["omni_thinkers_pp"][family], want, **torch_step.match)


@pytest.mark.parametrize("layout", ["omni_moe", "omni_moe_tp"])
def test_dp2_ep2_and_tp2_moe_omni_thinker_match_the_torch_trainer(
    tp2, omni_moe, omni_moe_tp, layout, torch_step
):
    """The Qwen3-Omni (MoE) thinker at DP=2 x EP=2, and at TP=2 (sequence parallelism: an odd sequence padded,
    HF's merged embeddings scattered over the TP ranks, DeepStack's visual embeddings sliced per rank, the
    experts whole on each rank), on image, video, audio and text rows: the torch trainer's logprobs and step
    (loss, grad norm, weights with the experts gathered and the towers)."""
    got = tp2[layout]
    want = torch_step.media_step_reference(got, *(omni_moe if layout == "omni_moe" else omni_moe_tp))
    assert any(".audio_tower." in n for n in want)
    torch_step.assert_same_weights(torch_step.fused(got["weights"]), want)


def test_tp2_moe_logprobs_step_and_export_match(tiny_qwen3_moe, tp2, moe_tp_batch, fuse_experts, torch_step):
    """Qwen3-MoE at TP=2: sequence parallelism (on by itself: megatron's MoE layer needs it; an odd sequence
    padded to a multiple of 2), experts whole on each TP rank. Frozen at EP=1 and at EP=2 (the same two ranks
    also expert-parallel): transformers' logprobs within 1e-5 and an HF-exact export. Trained at EP=1 (norm,
    router and expert gradients summed over the TP ranks): core's torch trainer's logprobs, loss, entropy,
    grad norm and updated weights (2e-4, as the other MoE steps)."""
    from relax.core.testing import torch_trainer

    model_dir, config, hf = tiny_qwen3_moe
    got = tp2["moe_tp"]
    ref = torch_trainer(model_dir, lr=1e-2, eps=1e-4, micro_batch_size=4)
    want_logprobs = ref.forward_logprobs(moe_tp_batch)
    assert float(want_logprobs.abs().sum()) > 1.0
    for ep in (1, 2):
        frozen = got[f"frozen_ep{ep}"]
        torch.testing.assert_close(frozen["logprobs"], want_logprobs, atol=1e-5, rtol=0)
        assert sorted(frozen["hf"]) == sorted(hf)
        for name, tensor in hf.items():
            assert torch.equal(frozen["hf"][name], tensor), (ep, name)
    torch.testing.assert_close(got["logprobs"], want_logprobs, atol=1e-5, rtol=0)
    torch_step.assert_same_weights(
        fuse_experts(got["weights"], config), torch_step.stepped_reference(got, ref, moe_tp_batch)
    )


def test_tp2_moe_checkpoint_loads_at_tp1_and_converts_to_hf(
    megatron_world, tiny_qwen3_moe, tp2, tp2_checkpoint, moe_tp_batch, tmp_path
):
    """The Qwen3-MoE dist checkpoint the TP=2 (sequence-parallel) ranks saved after their step: one TP=1 trainer
    loads it to the logprobs the ranks computed after saving, and ``relax convert`` writes the ranks'
    exported weights bit-exactly."""
    from safetensors.torch import load_file

    from relax.megatron.checkpoint import to_hf
    from relax.megatron.trainer import MegatronTrainer

    got, ckpt = tp2["moe_tp"], str(tp2_checkpoint) + "-moe"
    trainer = MegatronTrainer(tiny_qwen3_moe[0], micro_batch_size=4)
    trainer.load(ckpt)
    assert trainer.update.step == 1
    torch.testing.assert_close(
        trainer.forward_logprobs(moe_tp_batch), got["logprobs_after"], atol=1e-5, rtol=0
    )
    names = to_hf(ckpt, str(tmp_path / "hf"))
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(names) == sorted(written) == sorted(got["weights"])
    for name, tensor in got["weights"].items():
        assert torch.equal(written[name], tensor), name


def test_tp2_sequence_parallel_dense_model_matches_transformers(tiny_qwen3, tp2, moe_tp_batch):
    """``sequence_parallel: true`` on the dense Qwen3 at TP=2 (an odd sequence padded to a multiple of 2): the
    torch trainer's logprobs within 1e-5 and an HF-exact export."""
    from relax.core.testing import torch_trainer

    _, _, hf = tiny_qwen3
    got = tp2["dense_sp"]
    torch.testing.assert_close(
        got["logprobs"], torch_trainer(tiny_qwen3[0]).forward_logprobs(moe_tp_batch), atol=1e-5, rtol=0
    )
    assert sorted(got["hf"]) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got["hf"][name], tensor), name
