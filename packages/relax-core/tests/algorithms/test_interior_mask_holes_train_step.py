"""Interior mask holes end to end (issue 26): through the torch trainer's ``train_step`` (core's
``PolicyUpdate`` loop, the default objective, a real tiny Qwen3).

Two honest invariants of a multi-turn trajectory ``prompt | turn 1 | observation | turn 2``:

- it trains exactly like its turns split into single-turn samples whose prompts carry the history
  (``prompt | turn 1`` and ``prompt + turn 1 + observation | turn 2``) under a token-level
  aggregation: observation tokens are context, never trained on, and the loss, the entropy bonus and
  the IS correction count the sampled tokens only;
- whatever sits at the observation positions of the logprob / advantage columns (NaN, -inf: the
  rollout has no logprob there) does not change the gradient at all.
"""

from __future__ import annotations

import pytest
import torch

from relax.core.algorithms import AlgorithmConfig, CorrectionConfig, build_policy_objective
from relax.core.data import Sample, collate
from relax.core.testing.models import tiny_model_dir
from relax.core.trainers.torch_trainer import TorchTrainer

ADVANTAGES = (1.0, -0.5, 0.8, -1.2)


def make_trainer(model_dir: str, policy_loss: str) -> TorchTrainer:
    """lr 0: each ``train_step`` leaves the weights as they are and its gradients in ``p.grad``."""
    algorithm = AlgorithmConfig(
        policy_loss=policy_loss,
        loss_agg_mode="token-mean",
        entropy_coef=0.01,
        correction=CorrectionConfig(is_mode="truncate"),
    )
    return TorchTrainer(
        model_dir,
        objective=build_policy_objective(algorithm),
        lr=0.0,
        grad_clip=0.0,
        micro_batch_size=16,
        loss_agg_mode="token-mean",
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def trainer(model_dir):
    return make_trainer(model_dir, "ppo")


@pytest.fixture(scope="module")
def episodes(trainer):
    """(prompt, turn 1, observation, turn 2) token ids and per-token rollout logprobs of each turn."""
    gen = torch.Generator().manual_seed(3)
    special = set(trainer.tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(len(trainer.tokenizer)) if t not in special])

    def draw(n: int) -> list[int]:
        return vocab[torch.randint(len(vocab), (n,), generator=gen)].tolist()

    def logprobs(n: int) -> list[float]:
        return (-0.2 - 3 * torch.rand(n, generator=gen)).tolist()

    return [
        (
            draw(3 + i),
            draw(2 + i % 3),
            draw(2 + (i + 1) % 3),
            draw(3 - i % 2),
            logprobs(2 + i % 3),
            logprobs(3 - i % 2),
        )
        for i in range(len(ADVANTAGES))
    ]


def batch_of(samples: list[Sample], advantages: list[float], pad_id: int) -> dict[str, torch.Tensor]:
    batch = collate(samples, pad_id=pad_id)
    batch["advantages"] = torch.tensor(advantages)[:, None] * batch["response_mask"]
    return batch


def multi_turn(episodes, pad_id: int) -> dict[str, torch.Tensor]:
    samples = [
        Sample(
            prompt_ids=p,
            group_id=i // 2,
            index_in_group=i % 2,
            response_ids=t1 + obs + t2,
            loss_mask=[1.0] * len(t1) + [0.0] * len(obs) + [1.0] * len(t2),
            rollout_logprobs=lp1 + [0.0] * len(obs) + lp2,
        )
        for i, (p, t1, obs, t2, lp1, lp2) in enumerate(episodes)
    ]
    return batch_of(samples, list(ADVANTAGES), pad_id)


def split_turns(episodes, pad_id: int) -> dict[str, torch.Tensor]:
    samples, advantages = [], []
    for i, (p, t1, obs, t2, lp1, lp2) in enumerate(episodes):
        samples += [
            Sample(prompt_ids=p, group_id=2 * i, response_ids=t1, rollout_logprobs=lp1),
            Sample(prompt_ids=p + t1 + obs, group_id=2 * i + 1, response_ids=t2, rollout_logprobs=lp2),
        ]
        advantages += [ADVANTAGES[i]] * 2
    return batch_of(samples, advantages, pad_id)


def step_gradients(trainer, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = trainer.train_step(batch)
    return metrics, {
        n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None
    }


def test_a_multi_turn_trajectory_trains_like_its_turns_split_into_samples(trainer, episodes):
    pad = trainer.tokenizer.pad_token_id
    holed_metrics, holed = step_gradients(trainer, multi_turn(episodes, pad))
    split_metrics, split = step_gradients(trainer, split_turns(episodes, pad))
    assert holed.keys() == split.keys() and holed_metrics["grad_norm"] > 1e-3
    for name, grad in holed.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "is_weight_mean"):
        assert split_metrics[key] == pytest.approx(holed_metrics[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("policy_loss", ["ppo", "reinforce"])
def test_what_is_at_observation_positions_does_not_change_the_update(model_dir, episodes, policy_loss):
    # REINFORCE's -A log pi turned a NaN advantage there into NaN gradients (NonFiniteError) before the
    # objective zeroed masked inputs; PPO's clamped ratio already hid it
    trainer = make_trainer(model_dir, policy_loss)
    pad = trainer.tokenizer.pad_token_id
    clean = multi_turn(episodes, pad)
    clean["old_logprobs"] = trainer.forward_logprobs(clean)
    _, want = step_gradients(trainer, clean)

    observation = clean["response_mask"] == 0
    dirty = dict(clean)
    for column, sentinel in (
        ("old_logprobs", -float("inf")),
        ("rollout_logprobs", float("nan")),
        ("advantages", float("nan")),
    ):
        dirty[column] = clean[column].masked_fill(observation, sentinel)
    metrics, got = step_gradients(trainer, dirty)
    assert metrics["skipped_nonfinite"] == 0.0
    for name, grad in want.items():
        assert torch.equal(got[name], grad), (
            f"{name}: the gradient changed with what is at observation positions"
        )
