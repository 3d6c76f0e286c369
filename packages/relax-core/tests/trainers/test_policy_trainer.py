"""Core's trainer wrapper (``relax.core.trainers.policy_trainer``): the prologue and glue every backend uses.
The backends' own suites run the glue end to end; these pin its pieces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from relax.core.algorithms.config import AlgorithmConfig
from relax.core.config import TrainerConfig
from relax.core.context import PluginContext, TrainSpec
from relax.core.policy_update import PolicyUpdate, UpdateSettings
from relax.core.trainers.policy_trainer import PolicyTrainer, adamw_from, loop_inputs, seeded


def test_seeded_applies_the_overrides_and_seeds_every_rng():
    draws = []
    for _ in range(2):
        s = seeded(UpdateSettings(lr=0.5), {"seed": 7, "micro_batch_size": 3})
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    assert (s.lr, s.seed, s.micro_batch_size) == (0.5, 7, 3)
    assert draws[0] == draws[1]
    assert seeded(None, {}).lr == UpdateSettings().lr


def test_adamw_from_takes_the_settings():
    param = torch.nn.Parameter(torch.zeros(2))
    s = UpdateSettings(lr=0.25, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.5)
    group = adamw_from([param], s).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.25, (0.8, 0.9), 1e-3, 0.5)


@pytest.mark.parametrize("trainable", [True, False])
def test_loop_inputs_give_a_frozen_model_no_objective(trainable):
    spec = TrainSpec(
        optim=TrainerConfig(lr=0.05), algorithm=AlgorithmConfig(), total_steps=2, trainable=trainable
    )
    settings, objective = loop_inputs(PluginContext(role="trainer", model_path="unused", train=spec))
    assert settings.lr == 0.05
    assert (objective is not None) == trainable


class _Frozen(PolicyTrainer):
    def __init__(self):
        self.optimizer = None
        self.update = PolicyUpdate(self, UpdateSettings(), None)


def test_the_glue_refuses_a_frozen_trainer_and_keeps_the_loop_step():
    trainer = _Frozen()
    with pytest.raises(RuntimeError, match="trainable _Frozen with an objective"):
        trainer.train_step({})
    trainer.step = 4
    assert trainer.update.step == 4 and trainer.current_lr() == trainer.update.current_lr()
