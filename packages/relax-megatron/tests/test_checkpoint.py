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

    return MegatronTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, micro_batch_size=4)


class TestCheckpoint(TinyModelFixtures):
    @pytest.fixture(scope="class")
    def saved(self, megatron_world, model_dir, tokenizer, tmp_path_factory):
        """A trainer after one step, saved; then its second step (loss and weights) for comparison."""
        batches = [make_batch(make_samples(tokenizer, rows=8, seed=s), tokenizer.pad_token_id) for s in (3, 4)]
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
