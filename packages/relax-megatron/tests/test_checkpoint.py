"""Megatron dist checkpoints through the trainer (TP=1, in-process gloo): a resumed trainer continues
exactly like the one that saved, and ``relax convert`` turns the checkpoint into an HF directory that
plain transformers loads and greedy-generates from like the trainer's own weights."""

from __future__ import annotations

import pytest
import torch

from relax.core.testing import TinyModelFixtures, make_batch, make_samples
from relax.core.testing.trainer import exported


def megatron_trainer(model_dir: str):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, micro_batch_size=4
    )


class TestCheckpoint(TinyModelFixtures):
    @pytest.fixture(scope="class")
    def saved(self, megatron_world, model_dir, tokenizer, tmp_path_factory):
        """A trainer after one step, saved; then its second step (loss and weights) for comparison."""
        batches = [
            make_batch(make_samples(tokenizer, rows=8, seed=s), tokenizer.pad_token_id) for s in (3, 4)
        ]
        trainer = megatron_trainer(model_dir)
        trainer.train_step(batches[0])
        directory = tmp_path_factory.mktemp("megatron") / "ckpt"
        trainer.save(str(directory))
        at_save = exported(trainer)
        second = trainer.train_step(batches[1])
        return directory, batches[1], at_save, second, exported(trainer)

    def test_resume_continues_identically(self, saved, model_dir):
        directory, batch, _, second, after = saved
        resumed = megatron_trainer(model_dir)
        resumed.load(str(directory))
        assert resumed.update.step == 1
        metrics = resumed.train_step(batch)
        assert metrics["loss"] == second["loss"] and metrics["grad_norm"] == second["grad_norm"]
        for name, tensor in exported(resumed).items():  # equal only with the restored AdamW moments
            assert torch.equal(tensor, after[name]), name

    def test_relax_convert_writes_a_transformers_model(self, saved, model_dir, tokenizer, tmp_path):
        from transformers import AutoModelForCausalLM

        from relax.core.cli import main

        directory, _, at_save, _, _ = saved
        assert main(["convert", str(directory), str(tmp_path / "hf")]) == 0  # the registered subcommand
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        state = converted.state_dict()
        for name, tensor in at_save.items():
            assert torch.equal(state[name], tensor), name
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompt = tokenizer("12+7=", return_tensors="pt").input_ids
        greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        original.load_state_dict(at_save, strict=False)  # the trainer's weights at the save, in transformers
        want = original.generate(prompt, **greedy)
        assert torch.equal(converted.generate(prompt, **greedy), want)

    def test_a_missing_checkpoint_is_named(self, megatron_world, model_dir, tmp_path):
        with pytest.raises(FileNotFoundError, match="no megatron dist checkpoint at"):
            megatron_trainer(model_dir).load(str(tmp_path))


def test_relax_convert_reads_a_transformer_engine_checkpoint(megatron_world, tiny_qwen3, tmp_path):
    """A checkpoint written by the TE layer spec (a GPU run) keys the fused norms by TE names; ``relax
    convert`` rebuilds the model on the local spec here and still maps it back to the HF weights exactly.
    (The TE-keyed checkpoint is written from a local model with its keys renamed as TE names them.)"""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from relax.core.testing.models import load_hf_weights
    from relax.megatron import convert, gpt_model
    from relax.megatron.checkpoint import HF_DIR, to_hf, write_hf
    from relax.megatron.layer_specs import te_name

    model_dir, config, hf = tiny_qwen3
    model = gpt_model.build_gpt_model(config)
    convert.load_hf_into(model, hf, config)
    sharded = model.sharded_state_dict()
    for item in nested_values(sharded):
        if hasattr(item, "key"):
            item.key = te_name(item.key, moe=False)
    keys = {item.key for item in nested_values(sharded) if hasattr(item, "key")}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.input_layernorm.weight" not in keys
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save({"model": sharded}, str(tmp_path / "ckpt"))
    write_hf(str(tmp_path / "ckpt" / HF_DIR), None, config, model_dir)
    assert sorted(to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))) == sorted(hf)
    converted = load_hf_weights(str(tmp_path / "hf"))
    for name, tensor in hf.items():
        assert torch.equal(converted[name], tensor), name
