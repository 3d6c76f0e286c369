"""The fsdp trainer at world size 2 (two Ray actor processes, gloo) against world size 1 (this process),
on the same batch: the text model, a Qwen3-MoE text model, a VL model and an Omni (MoE) thinker give the
same loss, gradient norm and updated weights; each rank holds about half the training state; and a
checkpoint written at world 2 resumes at world 1 and at world 2 with the step the uninterrupted run took."""

from __future__ import annotations

import os
import sys
from functools import partial

import numpy as np
import pytest
import ray
import torch

from relax.core.data import Sample, collate
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples
from relax.core.testing.trainer import exported, learning_metrics
from relax.omni.tiny_models import tiny_multimodal_dir

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # build runs in the rank actors

# lr 1e-3: AdamW's first steps are ~lr * sign(grad), so float noise in a near-zero gradient moves a weight by
# up to ~lr * noise / eps; at 1e-3 that stays far below the 1e-5 the worlds must agree to
KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4}


def build(
    model_dir: str,
    rank: int = 0,
    world: int = 1,
    port: int | None = None,
    replicate: int = 1,
    context_parallel: int = 1,
    **settings,
):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(world_size=world, replicate=replicate, context_parallel=context_parallel),
        master_addr="127.0.0.1" if port else None,
        master_port=port,
        **KW,
        **settings,
    )


def state_bytes(trainer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, from the tensors' storage."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in trainer.model.parameters()]
    grads = [local(p.grad) for p in trainer.model.parameters() if p.grad is not None]
    optim = [
        local(v)
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim()
    ]
    return {
        k: sum(t.numel() * t.element_size() for t in ts)
        for k, ts in (("params", params), ("grads", grads), ("optim", optim))
    }


# ------------------------------------------------------------------ models and batches
def moe_model(root) -> str:
    """A tiny Qwen3-MoE causal LM (4 experts, 2 per token) with the quick-start tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    text = build_tiny_model(root / "text", seed=5)
    tokenizer = AutoTokenizer.from_pretrained(text)
    torch.manual_seed(5)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        decoder_sparse_step=1,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    return str(root / "moe")


def media_batch(model_dir: str, root) -> dict[str, torch.Tensor]:
    """Five rows: image, video, text-only, image, video (so one rank's micro-batch has no media)."""
    from PIL import Image

    from relax.core.testing.multimodal_processor import TinyMediaProcessor

    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(root / "img.png")
    np.save(root / "vid.npy", (rng.random((4, 56, 56, 3)) * 255).astype("uint8"))
    media = [
        {"type": "image", "image": str(root / "img.png")},
        {"type": "video", "video": f"file://{root / 'vid.npy'}"},
    ]
    processor = TinyMediaProcessor(model_dir)
    rows = [
        [{"role": "user", "content": [media[0], {"type": "text", "text": "what?"}]}],
        [{"role": "user", "content": [media[1], {"type": "text", "text": "what?"}]}],
        [{"role": "user", "content": "no media?"}],
    ]
    processed = [processor.process(rows[i % 3], [], f"row {i}") for i in (0, 1, 2, 0, 1)]
    answer = processor.hf.tokenizer.encode("it is a small picture of nothing much")
    samples = [
        Sample(
            prompt_ids=list(p["prompt_ids"]),
            group_id=i,
            response_ids=answer[i : i + 3],
            mm_inputs=p["inputs"],
        )
        for i, p in enumerate(processed)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.where(torch.arange(5)[:, None] % 2 == 0, 1.0, -0.5) * batch["response_mask"]
    return batch


def text_batch(model_dir: str, root) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return make_batch(make_samples(tokenizer, rows=5, seed=2), tokenizer.pad_token_id)


FAMILIES = {
    "text": (lambda root: build_tiny_model(root / "m", seed=4, initializer_range=0.2), text_batch),
    "qwen3_moe": (moe_model, text_batch),
    "qwen2_5_vl": (lambda root: tiny_multimodal_dir(root, "qwen2_5_vl"), media_batch),
    "qwen3_omni": (lambda root: tiny_multimodal_dir(root, "qwen3_omni"), media_batch),
}


#: world 2's own settings per variant: the same step in another layout
VARIANTS = {
    "hsdp": {"replicate": 2},
    "packed": {"max_tokens_per_micro_batch": 12, "pack_sequences": True},
    "ulysses": {"context_parallel": 2, "pack_sequences": True},
}


@pytest.mark.parametrize(
    "family", [*FAMILIES, "text-hsdp", "text-packed", "text-ulysses", "qwen3_moe-ulysses"]
)
def test_world_2_takes_the_step_world_1_takes(family, world2, tmp_path):
    """``text-hsdp``: a 2 x 1 (replicate x shard) HSDP mesh: replicas, each with the whole model.
    ``text-packed``: world 2 packs its rows into token-budget micro-batches (ranks run as many; rows
    balanced by tokens), world 1 runs padded fixed-row micro-batches. ``-ulysses``: Ulysses context
    parallelism, each rank a half of every micro-batch's packed tokens (attention heads all-to-all)."""
    family, _, variant = family.partition("-")
    make_model, make_batch_for = FAMILIES[family]
    model_dir = make_model(tmp_path)
    batch = make_batch_for(model_dir, tmp_path)
    single = build(model_dir)
    try:
        initial = exported(single)
        want_lp = single.forward_logprobs(batch)
        want = single.train_step(dict(batch))
        want_w = exported(single)
    finally:
        single.close()
    world2.build(partial(build, **VARIANTS.get(variant, {})), model_dir)
    torch.testing.assert_close(world2.call("forward_logprobs", batch), want_lp, atol=1e-5, rtol=0)
    got = world2.call("train_step", dict(batch))
    for key in ("loss", "entropy", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
    got_w = world2.export()
    assert got_w.keys() == want_w.keys()
    assert (
        max(float((want_w[n] - initial[n]).abs().max()) for n in want_w) > 5e-4
    )  # the step moved the weights
    for name, tensor in got_w.items():
        torch.testing.assert_close(tensor, want_w[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_each_rank_holds_half_the_training_state(world2, tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=4, initializer_range=0.2)
    batch = text_batch(model_dir, tmp_path)
    single = build(model_dir)
    try:
        single.train_step(dict(batch))
        whole = state_bytes(single)
    finally:
        single.close()
    world2.build(build, model_dir)
    world2.call("train_step", dict(batch))
    per_rank = world2.apply(state_bytes)
    for kind in ("params", "grads", "optim"):
        assert whole[kind] > 0 and per_rank[kind] <= 0.6 * whole[kind], (kind, per_rank, whole)


def test_a_world_2_checkpoint_resumes_at_world_1_and_2(world2, tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=4, initializer_range=0.2)
    batch = text_batch(model_dir, tmp_path)
    later = {**batch, "advantages": -batch["advantages"]}
    world2.build(build, model_dir)
    world2.call("train_step", dict(batch))
    world2.call("save", str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path / "ckpt" / "fsdp")
    want = world2.call("train_step", dict(later))
    want_w = world2.export()

    world2.build(build, model_dir)
    world2.call("load", str(tmp_path / "ckpt"))
    assert learning_metrics(world2.call("train_step", dict(later))) == learning_metrics(want)  # bit-identical
    assert all(torch.equal(t, want_w[n]) for n, t in world2.export().items())

    single = build(model_dir)
    try:
        single.load(str(tmp_path / "ckpt"))
        assert single.step == 1
        got = single.train_step(dict(later))
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5) and got["grad_norm"] == pytest.approx(
            want["grad_norm"], abs=1e-5
        )
        for name, tensor in exported(single).items():
            torch.testing.assert_close(
                tensor, want_w[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )
    finally:
        single.close()
