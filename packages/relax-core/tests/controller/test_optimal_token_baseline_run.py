"""Optimal token baselines in a run: the estimator declares ``sum_pi_squared`` and the policy trainer
provides it through an optional capability, so a colocate run through real Ray with the tiny
quick-start model trains with it, and a trainer backend without the capability is refused at
start-up naming the backend and the estimator."""

from __future__ import annotations

import json
import math

import pytest

from relax.core.config import load_config
from relax.core.controller.capabilities import CapabilityError, capabilities, check
from relax.core.controller.run import run
from relax.core.trainers.torch_trainer import TorchTrainer

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=8",
    "data.task_size=50",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]
OTB = "algorithm.advantage_estimator=optimal_token_baseline"


class LogprobsOnly:
    """A trainer backend that offers no optional method."""

    def forward_logprobs(self, batch): ...


def test_a_trainer_without_the_capability_is_refused_naming_backend_and_estimator():
    cfg = load_config(None, [*SMALL, OTB])  # config validation accepts it: the trainer is asked at start-up
    rollout = ("hf", capabilities(object()))
    with pytest.raises(CapabilityError) as err:
        check(cfg, {"trainer": ("logprobs_only", capabilities(LogprobsOnly())), "rollout": rollout})
    assert str(err.value) == (
        "trainer backend 'logprobs_only' does not implement forward_logprobs_and_sum_pi_squared() "
        "(per-token sum of squared policy probabilities, with the logprobs), needed by "
        "algorithm.advantage_estimator='optimal_token_baseline'"
    )
    check(cfg, {"trainer": ("torch", capabilities(TorchTrainer)), "rollout": rollout})
    grpo = load_config(None, SMALL)
    check(grpo, {"trainer": ("logprobs_only", []), "rollout": rollout})  # GRPO does not need it


def test_colocate_run_trains_with_the_trainers_sum_pi_squared(ray_local, tmp_path):
    cfg = load_config(None, [*SMALL, OTB, "total_steps=2", f"run_dir={tmp_path / 'run'}"])
    assert run(cfg)["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("adv/mean", "adv/abs_mean", "train/loss", "train/grad_norm"):
            assert math.isfinite(row[key]), (key, row[key])
        # sum_v pi^2 reached the estimator: between 1/V (uniform) and 1 (one-hot)
        assert 0.0 < row["policy/sum_pi_squared_mean"] < 1.0
        # old logprobs came from the same trainer forward (not fused into the update): colocate is
        # on-policy, so they agree with the engine's
        assert row["rollout/train_logprob_abs_diff"] < 1e-3
