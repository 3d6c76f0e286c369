"""bf16 training keeps fp32 master weights (precision.py), checked on CPU in bf16 (in-process gloo, TP=1).

Pure-bf16 AdamW rounds every RL-sized update away (the control below: ~2 % of weights move after 10
steps at lr 1e-6); with fp32 masters the bf16 trainer moves as many weights as the fp32 one, accumulates
and reduces its gradients in fp32, keeps its Adam state in fp32, and a checkpoint resumes from the fp32
masters, not from their bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from relax.core.testing import TinyModelFixtures, make_batch, make_samples
from relax.core.testing.trainer import exported

RL_LR, STEPS = 1e-6, 10


def megatron_trainer(model_dir: str, dtype: str, lr: float = RL_LR):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=lr, micro_batch_size=4, dtype=dtype
    )


def trained_weights(trainer) -> list[torch.Tensor]:
    """What the optimizer steps (bf16: the fp32 masters; pure bf16 would be the bf16 parameters)."""
    return [p for group in trainer.optimizer.param_groups for p in group["params"]]


def fraction_changed(trainer, batch: dict, steps: int = STEPS) -> float:
    weights = trained_weights(trainer)
    before = [w.detach().clone() for w in weights]
    for _ in range(steps):
        trainer.train_step(batch)
    changed = sum(int((w.detach() != b).sum()) for w, b in zip(weights, before, strict=True))
    return changed / sum(b.numel() for b in before)


def test_pure_bf16_adamw_loses_rl_sized_updates():
    """The control: AdamW stepping bf16 weights of the tiny model's scale directly moves few of them at
    lr 1e-6 (what the fraction-changed check below would see without fp32 masters)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((0.3 * torch.randn(4096, generator=gen)).to(torch.bfloat16))
    optimizer = torch.optim.AdamW([weight], lr=RL_LR)
    before = weight.detach().clone()
    for _ in range(STEPS):
        weight.grad = torch.randn(4096, generator=gen).to(torch.bfloat16)
        optimizer.step()
    assert float((weight.detach() != before).float().mean()) < 0.2


class TestBf16MasterWeights(TinyModelFixtures):
    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, tokenizer):
        return make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)

    def test_bf16_moves_as_many_weights_as_fp32_at_rl_learning_rates(self, megatron_world, model_dir, batch):
        fp32 = fraction_changed(megatron_trainer(model_dir, "float32"), batch)
        bf16_trainer = megatron_trainer(model_dir, "bfloat16")
        served = exported(bf16_trainer)
        bf16 = fraction_changed(bf16_trainer, batch)
        # what the engines get moved too (where a bf16 ulp is below the accumulated update)
        assert any(not torch.equal(t, served[n]) for n, t in exported(bf16_trainer).items())
        assert fp32 > 0.9
        assert bf16 == pytest.approx(fp32, abs=0.03)
        # the model runs in bf16, the optimizer steps fp32 masters with fp32 Adam moments
        dtypes = {n: p.dtype for n, p in bf16_trainer.model.named_parameters()}
        assert {d for n, d in dtypes.items() if "layernorm" not in n} == {
            torch.bfloat16
        }  # local spec: fp32 norms
        assert {w.dtype for w in trained_weights(bf16_trainer)} == {torch.float32}
        moments = {
            t.dtype for s in bf16_trainer.optimizer.state.values() for k, t in s.items() if k != "step"
        }
        assert moments == {torch.float32}
        # the bf16 weights are the masters rounded to nearest
        for param, master in zip(bf16_trainer.masters.params, bf16_trainer.masters.masters, strict=True):
            assert torch.equal(param.detach(), master.detach().to(param.dtype))

    def test_gradients_accumulate_and_reduce_in_fp32(self, megatron_world, model_dir, batch):
        """Two micro-batches per step: the gradients live on the fp32 masters (the bf16 ones are freed as
        autograd produces them), and the step's grad norm is the fp32 model's within bf16 forward noise."""
        fp32, bf16 = megatron_trainer(model_dir, "float32"), megatron_trainer(model_dir, "bfloat16")
        norm32, norm16 = fp32.train_step(batch)["grad_norm"], bf16.train_step(batch)["grad_norm"]
        assert norm16 == pytest.approx(norm32, rel=0.05)
        assert all(p.grad is None for p in bf16.model.parameters() if p.dtype == torch.bfloat16)
        grads = [w.grad for w in trained_weights(bf16)]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)

    def test_a_checkpoint_resumes_from_the_fp32_masters(self, megatron_world, model_dir, tokenizer, tmp_path):
        batches = [
            make_batch(make_samples(tokenizer, rows=8, seed=s), tokenizer.pad_token_id) for s in (3, 4)
        ]
        trainer = megatron_trainer(model_dir, "bfloat16", lr=1e-4)
        trainer.train_step(batches[0])
        trainer.save(str(tmp_path / "ckpt"))
        saved = [m.detach().clone() for m in trainer.masters.masters]
        assert any(
            not torch.equal(m, p.detach().float()) for m, p in zip(saved, trainer.masters.params, strict=True)
        )
        second = trainer.train_step(batches[1])
        resumed = megatron_trainer(model_dir, "bfloat16", lr=1e-4)
        resumed.load(str(tmp_path / "ckpt"))
        for mine, want in zip(resumed.masters.masters, saved, strict=True):
            assert torch.equal(mine.detach(), want)  # the fp32 values, not their bf16 rounding
        metrics = resumed.train_step(batches[1])
        assert metrics["loss"] == second["loss"] and metrics["grad_norm"] == second["grad_norm"]
        want = exported(trainer)
        for name, tensor in exported(resumed).items():
            assert torch.equal(tensor, want[name]), name
