"""Core's policy-update helpers without a model: the typed settings every backend takes, and the row
bookkeeping (mini-batches, data-parallel shares)."""

from dataclasses import replace

import pytest
import torch

from relax.core.algorithms.config import AlgorithmConfig, CriticConfig
from relax.core.config import TrainerConfig
from relax.core.context import PluginContext, TrainSpec
from relax.core.policy_update import UpdateSettings, replica_rows, shard_bounds, split_rows, take_rows


def test_settings_come_from_cores_train_spec():
    optim = TrainerConfig(
        lr=3e-3,
        micro_batch_size=2,
        num_minibatches=2,
        grad_clip=0.5,
        skip_nonfinite=True,
        lr_schedule="cosine",
        warmup_steps=1,
        min_lr_ratio=0.1,
        betas=[0.8, 0.9],
    )
    algorithm = replace(
        AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"), critic=CriticConfig(warmup_steps=3)
    )
    spec = TrainSpec(optim=optim, algorithm=algorithm, total_steps=7, temperature=0.7)
    s = UpdateSettings.from_context(PluginContext(role="trainer", seed=4, train=spec))
    assert (s.lr, s.micro_batch_size, s.num_minibatches, s.grad_clip, s.skip_nonfinite) == (
        3e-3,
        2,
        2,
        0.5,
        True,
    )
    assert (s.lr_schedule, s.warmup_steps, s.min_lr_ratio, s.total_steps, s.betas) == (
        "cosine",
        1,
        0.1,
        7,
        (0.8, 0.9),
    )
    assert (s.loss_agg_mode, s.temperature, s.seed, s.critic_warmup_steps) == (
        "seq-mean-token-sum",
        0.7,
        4,
        3,
    )


def test_overrides_replace_fields_and_name_unknown_ones():
    assert UpdateSettings().with_overrides(lr=0.5, micro_batch_size=3) == UpdateSettings(
        lr=0.5, micro_batch_size=3
    )
    with pytest.raises(TypeError, match=r"unknown trainer settings \['learning_rate'\].*'lr'"):
        UpdateSettings().with_overrides(learning_rate=0.5)
    with pytest.raises(ValueError, match="unknown lr_schedule 'step'; allowed: constant, linear, cosine"):
        UpdateSettings(lr_schedule="step")


def batch(rows: int) -> dict:
    return {
        "responses": torch.arange(rows * 2).view(rows, 2),
        "response_mask": torch.ones(rows, 2),
        "temperature": 0.7,
    }


def test_mini_batches_are_consecutive_row_slices_with_per_batch_values_passed_through():
    parts = list(split_rows(batch(5), 2))
    assert [p["responses"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8]]
    assert all(p["temperature"] == 0.7 for p in parts)
    assert take_rows(batch(5), 1, 3)["responses"].tolist() == [[2, 3], [4, 5]]


def test_replica_rows_share_the_rows_and_give_an_empty_replica_one_masked_row():
    assert [shard_bounds(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    first, second = replica_rows(batch(5), 0, 2), replica_rows(batch(5), 1, 2)
    assert first["responses"].tolist() == [[0, 1], [2, 3]] and second["responses"].tolist() == [
        [4, 5],
        [6, 7],
        [8, 9],
    ]
    empty = replica_rows(batch(1), 0, 2)  # one row over two replicas: the first trains on nothing
    assert empty["responses"].tolist() == [[0, 1]] and empty["response_mask"].sum() == 0
