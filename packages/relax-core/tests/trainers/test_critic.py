"""PPO critic: value head on an HF backbone, clipped value loss updates, warm-up, checkpoints."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.core.algorithms.config import AlgorithmConfig, CriticConfig
from relax.core.config import RelaxConfig
from relax.core.data import Sample, collate
from relax.core.quickstart_model import build_tiny_model
from relax.core.trainers.critic import Critic
from relax.core.trainers.torch_trainer import TorchTrainer, trainer_from_config


def pg_objective(inputs):
    """Plain -A log pi, token mean (enough to see whether the policy moved)."""
    mask = inputs.response_mask
    loss = -(inputs.advantages * inputs.logprobs * mask).sum() / mask.sum()
    return loss, {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2, initializer_range=0.3)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(6):
        prompt = torch.randint(4, 24, (2 + i % 3,), generator=gen).tolist()
        response = torch.randint(4, 24, (1 + (i * 2) % 4,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=prompt, group_id=i // 3, response_ids=response))
    out = collate(samples, pad_id=0)
    mask = out["response_mask"]
    out["advantages"] = torch.where(torch.arange(6)[:, None] % 2 == 0, 1.0, -1.0) * mask
    out["returns"] = torch.linspace(-1.0, 1.0, 6)[:, None] * mask  # per-sequence targets
    return out


def with_values(batch, critic):
    return {**batch, "values": critic.forward_values(batch)}


def test_value_model_starts_at_zero_on_the_policy_backbone(model_dir, batch):
    critic = Critic(model_dir, micro_batch_size=4)
    values = critic.forward_values(batch)
    assert values.shape == batch["response_mask"].shape
    assert torch.count_nonzero(values) == 0
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    for name, tensor in critic.model.backbone.state_dict().items():
        torch.testing.assert_close(tensor, policy.model.state_dict()[name], rtol=0, atol=0)


def test_value_of_a_token_depends_only_on_its_prefix(model_dir, batch):
    """Values are taken at positions P-1 .. P+R-2: changing response token t changes V_{t+1}, not V_0..V_t."""
    critic = Critic(model_dir, lr=5e-2)
    critic.update(with_values(batch, critic))  # move the zero head so values are informative
    changed = {k: v.clone() for k, v in batch.items()}
    row = int(batch["response_mask"].sum(dim=-1).argmax())
    p_len = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    assert batch["response_mask"][row].sum() == 3
    changed["input_ids"][row, p_len + 1] = (changed["input_ids"][row, p_len + 1] + 1) % 24  # response token 1
    before, after = critic.forward_values(batch)[row], critic.forward_values(changed)[row]
    torch.testing.assert_close(before[:2], after[:2])
    assert abs(float(before[2] - after[2])) > 1e-4


def test_updates_fit_the_returns_and_value_clip_bounds_each_step(model_dir, batch):
    mask = batch["response_mask"] > 0
    critic = Critic(model_dir, lr=1e-2, value_clip=10.0)
    first = critic.update(with_values(batch, critic))
    for _ in range(30):
        last = critic.update(with_values(batch, critic))
    assert first["vf_loss"] > 0.1 and last["vf_loss"] < 0.2 * first["vf_loss"]
    torch.testing.assert_close(critic.forward_values(batch)[mask], batch["returns"][mask], atol=0.3, rtol=0)

    tight = Critic(model_dir, lr=1e-2, value_clip=0.01)
    old = with_values(batch, tight)
    for _ in range(5):  # same old values: once V leaves [old - c, old + c] the clipped term wins
        metrics = tight.update(old)
    assert metrics["vf_clip_frac"] > 0.5


def test_warmup_trains_only_the_critic_then_both(model_dir, batch):
    critic = Critic(model_dir, lr=1e-2)
    trainer = TorchTrainer(model_dir, objective=pg_objective, lr=1e-2, critic=critic, critic_warmup_steps=1)
    policy_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    head_before = critic.model.head.weight.clone()
    metrics = trainer.train_step(with_values(batch, critic))
    assert metrics["actor_updated"] == 0.0 and "vf_loss" in metrics and "grad_norm" not in metrics
    assert all(torch.equal(v, policy_before[k]) for k, v in trainer.model.state_dict().items())
    assert not torch.equal(critic.model.head.weight, head_before)
    metrics = trainer.train_step(with_values(batch, critic))
    assert metrics["actor_updated"] == 1.0 and metrics["grad_norm"] > 0
    assert not all(torch.equal(v, policy_before[k]) for k, v in trainer.model.state_dict().items())


def test_checkpoint_carries_the_critic(model_dir, batch, tmp_path):
    trainer = TorchTrainer(model_dir, objective=pg_objective, lr=1e-2, critic=Critic(model_dir, lr=1e-2))
    trainer.train_step(with_values(batch, trainer.critic))
    trainer.save(str(tmp_path / "ckpt"))
    expected = trainer.critic.forward_values(batch)
    next_metrics = trainer.train_step(with_values(batch, trainer.critic))

    restored = TorchTrainer(model_dir, objective=pg_objective, lr=1e-2, critic=Critic(model_dir, lr=1e-2))
    restored.load(str(tmp_path / "ckpt"))
    torch.testing.assert_close(restored.critic.forward_values(batch), expected, rtol=0, atol=0)
    again = restored.train_step(with_values(batch, restored.critic))  # optimizer state restored too
    assert again["vf_loss"] == pytest.approx(next_metrics["vf_loss"], rel=1e-5)
    assert again["critic_grad_norm"] == pytest.approx(next_metrics["critic_grad_norm"], rel=1e-5)

    plain = TorchTrainer(model_dir, objective=pg_objective)
    plain.save(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="no critic state"):
        restored.load(str(tmp_path / "plain"))


def test_from_config_builds_the_critic(model_dir, batch):
    algorithm = AlgorithmConfig(
        advantage_estimator="gae", critic=CriticConfig(enable=True, lr=3e-3, value_clip=0.2, warmup_steps=2)
    )
    cfg = replace(RelaxConfig(), algorithm=algorithm)
    trainer = trainer_from_config(cfg, model_dir)
    assert trainer.critic is not None and trainer.settings.critic_warmup_steps == 2
    assert trainer.critic.optimizer.param_groups[0]["lr"] == 3e-3 and trainer.critic.value_clip == 0.2
    assert trainer_from_config(cfg, model_dir, reference=True).critic is None
    assert trainer_from_config(RelaxConfig(), model_dir).critic is None
    with pytest.raises(RuntimeError, match="critic"):
        trainer_from_config(RelaxConfig(), model_dir).forward_values(batch)


def test_token_budget_micro_batches_give_the_same_values_and_update(tmp_path):
    """``trainer.max_tokens_per_micro_batch`` on the critic: rows grouped by tokens, the same values in
    the batch's row order and the same update as row-count micro-batches."""
    from transformers import AutoTokenizer

    from relax.core.quickstart_model import build_tiny_model
    from relax.core.testing import make_batch, make_samples

    model_dir = build_tiny_model(tmp_path / "m", seed=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=4), tokenizer.pad_token_id)
    plain, budget = (
        Critic(model_dir, lr=1e-3, micro_batch_size=3),
        Critic(model_dir, lr=1e-3, micro_batch_size=3, max_tokens=14),
    )
    values = plain.forward_values(batch)
    torch.testing.assert_close(budget.forward_values(batch), values, atol=1e-6, rtol=0)
    batch = {**batch, "values": values, "returns": values + batch["advantages"]}
    want, got = plain.update(batch), budget.update(batch)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(budget.forward_values(batch), plain.forward_values(batch), atol=1e-5, rtol=0)


def test_recompute_gives_the_same_update_keeping_fewer_tensors(model_dir, batch):
    """``trainer.recompute: full`` on the critic (the memory plan counts on it): the same values and update, and
    its backward keeps fewer saved tensors (each decoder layer's input only)."""
    plain, recomputed = Critic(model_dir, lr=1e-3), Critic(model_dir, lr=1e-3, recompute="full")
    values = plain.forward_values(batch)
    torch.testing.assert_close(recomputed.forward_values(batch), values, atol=0, rtol=0)
    saved: dict[int, int] = {}

    def counted(critic: Critic) -> int:
        def pack(x: torch.Tensor) -> torch.Tensor:
            saved[id(critic)] = saved.get(id(critic), 0) + 1
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            critic._values({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return saved[id(critic)]

    assert counted(recomputed) < counted(plain) / 2
    batch = {**batch, "values": values, "returns": values + batch["advantages"]}
    want, got = plain.update(batch), recomputed.update(batch)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_a_bfloat16_critic_trains_fp32_masters(model_dir, batch):
    """dtype bfloat16 is the forwards' (autocast): the critic's weights, gradients and AdamW state stay fp32, so an
    update at lr 1e-6 moves the weights (a bf16 weight near 1.0 has a spacing of 2^-7)."""
    critic = Critic(model_dir, lr=1e-6, dtype="bfloat16")
    assert {p.dtype for p in critic.model.parameters()} == {torch.float32}
    with torch.no_grad():  # a head that is not zero, so the backbone gets gradients in this first update
        critic.model.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    values = critic.forward_values(batch)
    assert values.dtype == torch.float32
    before = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
    critic.update({**batch, "values": values})
    norms = [n for n in before if n.endswith("norm.weight")]  # weights near 1.0, every one used
    moved = sum(int((dict(critic.model.named_parameters())[n] != before[n]).sum()) for n in norms)
    assert moved > 0.9 * sum(before[n].numel() for n in norms), moved
    assert {s["exp_avg"].dtype for s in critic.optimizer.state.values()} == {torch.float32}
