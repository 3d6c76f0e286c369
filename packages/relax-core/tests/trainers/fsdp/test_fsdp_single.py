"""The fsdp trainer in this process (a world of one): core's conformance kit, agreement with the torch
trainer and the HF engine, mixed precision that keeps an RL learning rate's update, activation
checkpointing that changes memory, not results, and the typed ``trainer.backend_params``."""

from __future__ import annotations

import json

import pytest
import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.policy_update import even_replica_rows, shard_bounds
from relax.core.testing import (
    LogprobAgreementConformance,
    TinyModelFixtures,
    TrainerConformance,
    make_batch,
    make_samples,
    torch_trainer,
)
from relax.core.testing.trainer import exported
from relax.core.trainers.fsdp.params import FSDPParams, dtype_problem

KW = {"lr": 1e-2, "micro_batch_size": 4}


def fsdp_trainer(model_dir: str, params: FSDPParams | None = None, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), params=params, **{**KW, **kw}
    )


class TestFSDPTrainerConformance(TrainerConformance):
    def make_trainer(self, model_dir):
        return fsdp_trainer(model_dir)

    def close_trainer(self, trainer):
        trainer.close()


class TestHFEngineFSDPTrainerAgreement(LogprobAgreementConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)

    def make_trainer(self, model_dir):
        return fsdp_trainer(model_dir)

    def close_trainer(self, trainer):
        trainer.close()


class TestAgainstTheTorchTrainer(TinyModelFixtures):
    def test_one_step_matches_the_torch_trainer(self, model_dir, tokenizer):
        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        ref, fsdp = torch_trainer(model_dir, **KW, eps=1e-4), fsdp_trainer(model_dir, eps=1e-4)
        try:
            torch.testing.assert_close(
                fsdp.forward_logprobs(batch), ref.forward_logprobs(batch), atol=1e-6, rtol=0
            )
            m_ref, m_fsdp = ref.train_step(dict(batch)), fsdp.train_step(dict(batch))
            for key in ("loss", "entropy", "grad_norm"):
                assert m_fsdp[key] == pytest.approx(m_ref[key], abs=1e-5), key
            want, got = exported(ref), exported(fsdp)
            assert got.keys() == want.keys()
            for name, tensor in got.items():
                torch.testing.assert_close(
                    tensor, want[name], atol=2e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
                )
        finally:
            fsdp.close()

    def test_activation_checkpointing_gives_the_same_step(self, model_dir, tokenizer):
        batch = make_batch(make_samples(tokenizer, rows=8, seed=4), tokenizer.pad_token_id)
        metrics, weights, mlp_runs = [], [], []
        for ac in (False, True):
            t = fsdp_trainer(model_dir, FSDPParams(activation_checkpointing=ac))
            runs, mlp = [], t.model.model.layers[0].mlp
            mlp.forward = lambda *a, _f=mlp.forward, _runs=runs, **k: (
                _runs.append(1) or _f(*a, **k)
            )  # hooks skip recomputes
            try:
                metrics.append(t.train_step(dict(batch)))
                weights.append(exported(t))
                mlp_runs.append(len(runs))
            finally:
                t.close()
        assert mlp_runs[1] == 2 * mlp_runs[0] > 0  # recomputed in backward: activations were not kept
        assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-6)
        for name, tensor in weights[1].items():
            torch.testing.assert_close(tensor, weights[0][name], atol=1e-6, rtol=0)

    def test_bf16_keeps_fp32_masters_so_a_small_lr_still_moves_the_weights(self, model_dir, tokenizer):
        """10 steps at lr 1e-6: pure-bf16 weights would round most updates away (~2 % change); the
        fp32 master copy keeps them, so bf16 compute changes as many weights as fp32 does."""
        batch = make_batch(make_samples(tokenizer, rows=8, seed=5), tokenizer.pad_token_id)
        changed = {}
        for dtype in ("float32", "bfloat16"):
            t = fsdp_trainer(model_dir, dtype=dtype, lr=1e-6)
            try:
                before = {n: p.detach().clone() for n, p in t.model.state_dict().items()}
                assert all(p.dtype == torch.float32 for p in t.model.parameters())  # the masters
                for _ in range(10):
                    t.train_step(dict(batch))
                after = t.model.state_dict()
                moved = sum(int((after[n].detach() != before[n]).sum()) for n in before)
                changed[dtype] = moved / sum(v.numel() for v in before.values())
                assert {x.dtype for b in t.export_weights() for _, x in b} == {getattr(torch, dtype)}
            finally:
                t.close()
        assert changed["float32"] > 0.9
        assert changed["bfloat16"] == pytest.approx(changed["float32"], abs=0.03), changed


def test_freeze_audio_keeps_the_audio_tower_as_loaded_and_out_of_the_export(tmp_path_factory):
    """``freeze_audio`` (Qwen2.5-Omni thinker, image and audio rows): the audio tower gets no update and is not
    exported; the vision tower trains and is exported."""
    import numpy as np
    from PIL import Image

    from relax.core.data import Sample, collate
    from relax.core.testing.multimodal_processor import TinyMediaProcessor
    from relax.omni.tiny_models import tiny_multimodal_dir

    root = tmp_path_factory.mktemp("freeze")
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_omni")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(root / "img.png")
    np.save(root / "tone.npy", np.sin(np.arange(8000) * 0.05).astype("float32"))
    processor = TinyMediaProcessor(model_dir)
    processed = [
        processor.process([{"role": "user", "content": [item, {"type": "text", "text": "what?"}]}], [], kind)
        for kind, item in (
            ("image", {"type": "image", "image": str(root / "img.png")}),
            ("audio", {"type": "audio", "audio": str(root / "tone.npy")}),
        )
    ]
    answers = [processor.hf.tokenizer.encode(t) for t in ("a dot", "a tone")]
    samples = [
        Sample(prompt_ids=list(p["prompt_ids"]), group_id=i, response_ids=a, mm_inputs=p["inputs"])
        for i, p in enumerate(processed)
        for a in answers
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * batch["response_mask"]
    t = fsdp_trainer(model_dir, FSDPParams(freeze_audio=True))
    try:
        assert t.frozen_towers == {"audio"}
        before = exported(t)
        loaded = {
            n: p.detach().clone() for n, p in t.model.named_parameters() if n.startswith("model.audio_tower.")
        }
        t.train_step(dict(batch))
        after = exported(t)
        assert loaded and all(
            torch.equal(p.detach(), loaded[n]) for n, p in t.model.named_parameters() if n in loaded
        )
        assert not any(n.startswith("model.audio_tower.") for n in after) and after.keys() == before.keys()
        vision = [n for n in after if n.startswith("model.visual.")]
        assert vision and any(not torch.equal(after[n], before[n]) for n in vision), (
            "the vision tower did not train"
        )
    finally:
        t.close()


def test_even_replica_rows_gives_every_rank_the_same_rows_and_pads_with_masked_ones():
    from relax.core.data import Sample, collate

    batch = collate(
        [Sample(prompt_ids=[1, 2], group_id=i, response_ids=[3, 4 + i]) for i in range(5)], pad_id=0
    )
    shares = [even_replica_rows(batch, r, 2) for r in range(2)]
    assert [s["responses"].shape[0] for s in shares] == [3, 3]
    s, e = shard_bounds(5, 0, 2)
    assert torch.equal(shares[0]["responses"][: e - s], batch["responses"][s:e])
    assert shares[0]["response_mask"][2:].sum() == 0 and shares[1]["response_mask"].sum() > 0  # rank 0 padded
    assert even_replica_rows(batch, 0, 1)["responses"].shape[0] == 5


def test_backend_params_name_the_field_of_a_bad_combination():
    assert FSDPParams().validate() == []
    assert FSDPParams(world_size=4, replicate=2).validate() == []
    assert FSDPParams(world_size=3, replicate=2).validate() == [
        "replicate: must divide world_size (3), got 2"
    ]
    assert FSDPParams(cpu_offload=True).validate()[0].startswith("cpu_offload:")
    assert FSDPParams(device="tpu").validate() == ["device: expected 'cpu' or 'cuda', got 'tpu'"]
    assert FSDPParams(world_size=2, context_parallel=2).validate() == []  # Ulysses over every rank
    assert FSDPParams(world_size=4, context_parallel=2).validate() == []  # 2 replicas x 2 CP ranks
    (cp,) = FSDPParams(world_size=4, context_parallel=3).validate()
    assert cp.startswith("context_parallel: must be >= 1 and divide world_size (4)") and cp.endswith("got 3")
    (hsdp,) = FSDPParams(world_size=4, replicate=2, context_parallel=2).validate()
    assert hsdp.startswith("context_parallel: 2 with replicate: 2 (HSDP) is not built")
    assert dtype_problem("float16", "cpu").startswith("dtype: float16 needs loss scaling")
    assert dtype_problem("bfloat16", "cpu") is None


def test_relax_validate_names_the_inherited_dtype_and_offload_memory(tmp_path):
    from relax.core.config import ConfigError, load_config
    from relax.core.quickstart_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", seed=1)
    base = [f"model.path={model}", f"run_dir={tmp_path / 'run'}", "trainer.backend=fsdp"]
    with pytest.raises(
        ConfigError, match=r"model\.dtype: float16 needs loss scaling.*set trainer\.backend_params\.dtype"
    ):
        load_config(None, [*base, "model.dtype=float16"])
    assert (
        load_config(
            None, [*base, "model.dtype=float16", "trainer.backend_params.dtype=bfloat16"]
        ).trainer.backend
        == "fsdp"
    )
    big = FSDPParams(device="cuda", cpu_offload=True, world_size=10**9)  # a billion ranks' state on one host
    (err,) = big.validate_run(load_config(None, base))
    assert err.startswith("trainer.backend_params.cpu_offload: the offloaded training state needs ~")
    (replay,) = FSDPParams(activation_checkpointing=True).validate_run(
        load_config(None, [*base, "algorithm.routing_replay=rollout"])
    )
    assert replay.startswith("trainer.backend_params.activation_checkpointing with algorithm.routing_replay")
    (cp,) = FSDPParams(world_size=2, context_parallel=2).validate_run(load_config(None, base))
    assert (
        cp
        == "trainer.backend_params.context_parallel: splits packed rows over the ranks; set trainer.pack_sequences: true"
    )


def test_relax_convert_writes_an_fsdp_checkpoint_as_a_transformers_model(tmp_path, capsys):
    """Offline, in this process: the sharded checkpoint's weights, read into a plain HF model."""
    from transformers import AutoModelForCausalLM

    from relax.core.cli import main
    from relax.core.quickstart_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", seed=2)
    t = fsdp_trainer(model_dir)
    try:
        t.train_step(make_batch(make_samples(t.tokenizer, rows=4), t.tokenizer.pad_token_id))
        t.save(str(tmp_path / "step_1" / "trainer"))
        want = exported(t)
    finally:
        t.close()
    assert main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf")]) == 0
    assert "from a fsdp checkpoint" in capsys.readouterr().out
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "again")]) == 2  # an HF dir is no checkpoint
    assert "no registered checkpoint format recognises" in capsys.readouterr().out
    # the model the run started from: the checkpoint records it (a whole Qwen-Omni comes back whole); gone, or
    # a --model that is not there, is said, never silently ignored
    (tmp_path / "step_1" / "controller.json").write_text(
        json.dumps({"step": 1, "model_path": str(tmp_path / "moved")})
    )
    with pytest.warns(UserWarning, match="moved is gone: .* holds the trained model as loaded"):
        assert main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf2")]) == 0
    assert (
        main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf3"), "--model", str(tmp_path / "nope")])
        == 2
    )
    assert "--model" in capsys.readouterr().out and not (tmp_path / "hf3").exists()
    assert main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf3"), "--model", model_dir]) == 0


def test_a_constructor_that_fails_leaves_no_process_group_behind(tmp_path):
    """The trainer creates torch's default group first; a construction that then raises destroys it, so the
    next trainer (or a megatron world) in the process can create its own (a leak made 90 later tests error)."""
    import torch.distributed as dist

    from relax.core.testing import tiny_model_dir

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="trainer.recompute: 'selective' is megatron's"):
        fsdp_trainer(tiny_model_dir(tmp_path), recompute="selective")
    assert not dist.is_initialized()
