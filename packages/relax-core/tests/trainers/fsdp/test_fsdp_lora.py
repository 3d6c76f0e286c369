"""LoRA on the fsdp trainer (``trainer.lora`` with ``trainer.backend: fsdp``): world size 2 (two Ray actor
processes, gloo) against the torch trainer's LoRA on the same batch -- the same logprobs, reference (base)
logprobs, steps and adapter exports; only the adapters trained; the adapter checkpoint round trip; the
final PEFT export."""

from __future__ import annotations

import json
import sys

import pytest
import ray
import torch
from safetensors.torch import load_file

from relax.core.config import LoraConfig
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples, torch_trainer
from relax.core.testing.trainer import exported, learning_metrics

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # fsdp_lora runs in the rank actors

LORA = LoraConfig(rank=4, alpha=8.0, export_merged=True)
# as test_fsdp_ranks: lr 1e-3 keeps float noise in AdamW's first steps far below the 1e-5 the trainers must agree to
KW = {"lr": 1e-3, "micro_batch_size": 2, "num_minibatches": 2, "eps": 1e-4}


def fsdp_lora(model_dir: str, rank: int = 0, world: int = 1, port: int | None = None, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        rank=rank,
        world_size=world,
        params=FSDPParams(world_size=world),
        master_addr="127.0.0.1" if port else None,
        master_port=port,
        **{"lora": LORA, **KW, **kw},
    )


def steps(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Two updates: the first moves only lora_B (B starts at 0, so A has no gradient), the second both."""
    return [dict(batch), {**batch, "advantages": -batch["advantages"]}]


def trained(trainer) -> dict:
    """What a rank trains: names, dtypes, and whether the optimizer holds (state for) exactly those."""
    named = dict(trainer.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    return {
        "trainable": sorted(trainable),
        "optimizer_is_trainable": in_optimizer == {id(named[n]) for n in trainable},
        "state_is_trainable": set(map(id, trainer.optimizer.state)) == in_optimizer,
        "frozen_dtypes": {str(p.dtype) for n, p in named.items() if n not in trainable},
        "trained_dtypes": {str(named[n].dtype) for n in trainable},
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fsdp_lora") / "m", seed=4, initializer_range=0.2)


@pytest.fixture(scope="module")
def lora_batch(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return make_batch(make_samples(tokenizer, rows=5, seed=2), tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def torch_run(model_dir, lora_batch, tmp_path_factory):
    """The torch trainer's LoRA run on the batch: what the fsdp world must reproduce."""
    trainer = torch_trainer(model_dir, lora=LORA, **KW)
    run = {"initial": exported(trainer), "logprobs": trainer.forward_logprobs(lora_batch)}
    run["metrics"] = [trainer.train_step(b) for b in steps(lora_batch)]
    run["reference"] = trainer.forward_reference_logprobs(lora_batch)
    run["adapter"] = exported(trainer)
    run["final"] = tmp_path_factory.mktemp("torch_final")
    trainer.save_hf(str(run["final"]))
    return run


def assert_close_each(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_world_2_takes_the_torch_trainers_lora_steps(world2, model_dir, lora_batch, torch_run):
    world2.build(fsdp_lora, model_dir)
    initial = world2.export()
    assert initial and all(
        n.endswith((".lora_A.weight", ".lora_B.weight")) for n in initial
    )  # the adapter only
    assert_close_each(initial, torch_run["initial"], atol=0)  # the same seeded adapters (B = 0)
    torch.testing.assert_close(
        world2.call("forward_logprobs", lora_batch), torch_run["logprobs"], atol=1e-5, rtol=0
    )
    for got, want in zip(
        [world2.call("train_step", b) for b in steps(lora_batch)], torch_run["metrics"], strict=True
    ):
        for key in ("loss", "entropy", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
    # the reference is the base with the adapters disabled: still the untrained policy's logprobs
    reference = world2.call("forward_reference_logprobs", lora_batch)
    torch.testing.assert_close(reference, torch_run["reference"], atol=1e-5, rtol=0)
    torch.testing.assert_close(reference, torch_run["logprobs"], atol=1e-5, rtol=0)
    adapter = world2.export()
    assert (
        min(float(adapter[n].abs().max()) for n in adapter if n.endswith("lora_B.weight")) > 5e-4
    )  # B moved
    assert (
        max(float((adapter[n] - initial[n]).abs().max()) for n in adapter if n.endswith("lora_A.weight"))
        > 5e-4
    )
    assert_close_each(adapter, torch_run["adapter"], atol=1e-5)


def test_only_the_adapters_are_trained_and_have_optimizer_state(world2, model_dir, lora_batch):
    world2.build(fsdp_lora, model_dir)
    world2.call("train_step", dict(lora_batch))
    got = world2.apply(trained)
    assert got["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in got["trainable"]), got[
        "trainable"
    ][:4]
    assert got["optimizer_is_trainable"] and got["state_is_trainable"]
    assert got["frozen_dtypes"] == got["trained_dtypes"] == {"torch.float32"}


def test_a_bfloat16_run_keeps_the_base_in_bfloat16_and_the_adapters_in_fp32(model_dir, lora_batch, tmp_path):
    trainer = fsdp_lora(
        model_dir, dtype="bfloat16", lora=LoraConfig(rank=4, alpha=8.0)
    )  # export_merged false
    try:
        named = dict(trainer.model.named_parameters())
        assert {p.dtype for p in named.values() if not p.requires_grad} == {torch.bfloat16}
        assert {p.dtype for p in named.values() if p.requires_grad} == {torch.float32}
        assert trainer.train_step(dict(lora_batch))["grad_norm"] > 0
        sent = exported(trainer)
        assert {t.dtype for t in sent.values()} == {torch.bfloat16}  # the engines' dtype
        trainer.save_hf(str(tmp_path / "final"))
        saved = load_file(
            tmp_path / "final" / "adapter_model.safetensors"
        )  # PEFT names: base_model.model.<module>...
        assert {n.removeprefix("base_model.model.") for n in saved} == set(sent) and not (
            tmp_path / "final" / "merged"
        ).exists()
        assert {t.dtype for t in saved.values()} == {
            torch.float32
        }  # the trained fp32 adapter, as the torch trainer saves it
    finally:
        trainer.close()


def test_the_adapter_checkpoint_round_trip_and_final_export(
    world2, model_dir, lora_batch, torch_run, tmp_path
):
    import torch.distributed.checkpoint as dcp

    from relax.core.trainers.fsdp import state

    first, later = steps(lora_batch)
    world2.build(fsdp_lora, model_dir)
    world2.call("train_step", first)
    world2.call("save", str(tmp_path / "ckpt"))
    saved = (
        dcp.FileSystemReader(str(tmp_path / "ckpt" / state.SHARDS_DIR)).read_metadata().state_dict_metadata
    )
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no base weights
    assert any(
        k.startswith("optim.state.") and k.endswith("exp_avg") for k in saved
    )  # the adapter's AdamW moments
    want = world2.call("train_step", later)
    world2.call("save_hf", str(tmp_path / "final"))
    want_w = world2.export()

    world2.build(fsdp_lora, model_dir)
    world2.call("load", str(tmp_path / "ckpt"))
    assert learning_metrics(world2.call("train_step", later)) == learning_metrics(
        want
    )  # bit-identical resume
    assert all(torch.equal(t, want_w[n]) for n, t in world2.export().items())

    # the final export: the torch trainer's PEFT adapter and merged weights after the same two steps
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert_close_each(
            load_file(tmp_path / "final" / name), load_file(torch_run["final"] / name), atol=1e-5
        )
    for name in ("adapter_config.json", "merged/config.json"):
        got, want = (json.loads((d / name).read_text()) for d in (tmp_path / "final", torch_run["final"]))
        for config in (got, want):  # peft writes a set: its order is the process's
            config["target_modules"] = sorted(config.get("target_modules", []))
        assert got == want, name

    with pytest.raises(ValueError, match="a LoRA checkpoint holds the adapter only"):
        state.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "converted"))
    full = fsdp_lora(model_dir, lora=None)
    try:
        with pytest.raises(ValueError, match="checkpoint has LoRA adapter, but trainer.lora is null"):
            full.load(str(tmp_path / "ckpt"))
    finally:
        full.close()


def test_relax_validate_accepts_lora_on_the_fsdp_backend(tmp_path, model_dir):
    from relax.core.config import load_config

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "trainer.backend=fsdp",
            "trainer.lora.rank=8",
        ],
    )
    assert cfg.trainer.backend == "fsdp" and cfg.trainer.lora.rank == 8


def test_modules_to_save_are_fp32_masters_on_a_bfloat16_base(model_dir, lora_batch):
    """As on the torch trainer: every trained shard is fp32 (adapters and modules_to_save copies), so at lr 1e-6
    the RMSNorm copies (weights near 1.0, bf16 spacing 2^-7) move; the export goes out in bf16."""
    trainer = fsdp_lora(
        model_dir, dtype="bfloat16", lora=LoraConfig(rank=4, alpha=8.0, modules_to_save=["norm"]), lr=1e-6
    )
    try:

        def copies():
            return {
                n: p.detach().full_tensor().clone()
                for n, p in trainer.model.named_parameters()
                if ".modules_to_save." in n
            }

        before = copies()
        assert before and {t.dtype for t in before.values()} == {torch.float32}
        trainer.train_step(dict(lora_batch))
        after = copies()
        moved = sum(int((after[n] != before[n]).sum()) for n in before) / sum(
            t.numel() for t in before.values()
        )
        assert moved > 0.9, moved
        sent = exported(trainer)
        assert any(n.endswith("norm.weight") for n in sent) and {t.dtype for t in sent.values()} == {
            torch.bfloat16
        }
    finally:
        trainer.close()
