"""Impossible algorithm combinations are rejected before anything starts, naming field and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.core.algorithms.config import AlgorithmConfig, CriticConfig
from relax.core.algorithms.validate import algorithm_config_errors
from relax.core.config import ConfigError, RelaxConfig, RolloutConfig, load_config

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
BASE = ["rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=3", "total_steps=10"]

BAD = [
    (
        ["algorithm.advantage_estimator=rloo", "rollout.n_samples_per_prompt=1"],
        "rollout.n_samples_per_prompt: advantage estimator 'rloo' compares responses within a group and needs >= 2, got 1",
    ),
    (
        ["algorithm.advantage_estimator=gae"],
        "algorithm.critic.enable: advantage estimator 'gae' needs critic values; set algorithm.critic.enable=true",
    ),
    (
        ["algorithm.critic.enable=true"],
        "algorithm.critic.enable: advantage estimator 'grpo' does not use critic values (estimators that do: 'gae')",
    ),
    (
        [
            "algorithm.advantage_estimator=gae",
            "algorithm.critic.enable=true",
            "algorithm.critic.warmup_steps=10",
        ],
        "algorithm.critic.warmup_steps: must be in [0, total_steps=10) so the policy trains at all, got 10",
    ),
    (
        [
            "algorithm.advantage_estimator=gae",
            "algorithm.critic.enable=true",
            "algorithm.critic.model_path=/no/such",
        ],
        "algorithm.critic.model_path: '/no/such' is not a directory",
    ),
    (
        ["algorithm.advantage_estimator=reinforce_plus_plus"],
        "algorithm.kl.coef: advantage estimator 'reinforce_plus_plus' regularises towards a reference model",
    ),
    (
        ["algorithm.advantage_estimator=remax"],
        "algorithm.greedy_baseline: advantage estimator 'remax' uses the reward of a greedy response as its "
        "baseline; set algorithm.greedy_baseline=true",
    ),
    (
        ["algorithm.greedy_baseline=true"],
        "algorithm.greedy_baseline: advantage estimator 'grpo' ignores the greedy baseline (estimators that use it: 'remax')",
    ),
    (
        ["algorithm.policy_loss=opd"],
        "algorithm.teacher_model_path: policy loss 'opd' needs a distillation teacher; "
        "set an HF model directory or 'policy_init'",
    ),
    (
        ["algorithm.opd_coef=0.5"],
        "algorithm.teacher_model_path: algorithm.opd_coef > 0 needs a distillation teacher",
    ),
    (["algorithm.teacher_model_path=policy_init"], "algorithm.teacher_model_path: set but unused"),
    (
        ["algorithm.policy_loss=opd", "algorithm.teacher_model_path=/no/teacher"],
        "algorithm.teacher_model_path: '/no/teacher' is neither 'policy_init' nor a directory",
    ),
    (
        ["algorithm.policy_loss=opd", "algorithm.teacher_model_path=policy_init", "algorithm.opd_coef=1"],
        "algorithm.opd_coef: policy loss 'opd' already reads teacher logprobs (distillation); set opd_coef=0",
    ),
    (
        [
            "algorithm.advantage_estimator=reinforce_plus_plus",
            "algorithm.kl.coef=0.1",
            "rollout.n_samples_per_prompt=1",
            "algorithm.dynamic_sampling.enable=true",
        ],
        "algorithm.dynamic_sampling.enable: drops groups whose rewards are all equal, so every group of "
        "rollout.n_samples_per_prompt=1 would be dropped; needs >= 2",
    ),
    (
        ["algorithm.dynamic_sampling.max_extra_rounds=-1"],
        "algorithm.dynamic_sampling.max_extra_rounds: must be >= 0",
    ),
    (
        ["algorithm.overlong.buffer=4"],
        "algorithm.overlong.buffer: must be in [0, rollout.max_new_tokens=3] (0 disables), got 4",
    ),
    (
        ["algorithm.policy_loss=cispo", "algorithm.loss_params={tau_pos: 1.0}"],
        "algorithm.loss_params.tau_pos: policy loss 'cispo' takes no parameter 'tau_pos'; it takes: clip_ratio_low, clip_ratio_high",
    ),
    (
        ["algorithm.advantage_params={gamma: 0.9}"],
        "algorithm.advantage_params.gamma: advantage estimator 'grpo' takes no parameter 'gamma'; it takes: epsilon, norm_adv_by_std",
    ),
    (
        [
            "algorithm.correction.is_mode=truncate",
            "algorithm.correction.is_low=2.0",
            "algorithm.correction.is_high=2.0",
        ],
        "algorithm.correction.is_low/is_high: need 0 <= is_low < is_high for is_mode 'truncate', got 2.0, 2.0",
    ),
    (["algorithm.correction.opsm_delta=-1"], "algorithm.correction.opsm_delta: must be >= 0 or null"),
    (["algorithm.lam=1.5"], "algorithm.lam: must be in [0, 1], got 1.5"),
    (["algorithm.loss_scale_factor=0"], "algorithm.loss_scale_factor: must be > 0 or null"),
    (["algorithm.entropy_coef=-0.1"], "algorithm.entropy_coef: must be >= 0 (a bonus)"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=["+".join(b[0]) for b in BAD])
def test_impossible_combination_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, *overrides])
    assert message in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "algorithm.advantage_estimator=gae",
            "algorithm.critic.enable=true",
            "algorithm.critic.warmup_steps=3",
        ],
        [
            "algorithm.advantage_estimator=remax",
            "algorithm.greedy_baseline=true",
            "rollout.n_samples_per_prompt=1",
        ],
        [
            "algorithm.advantage_estimator=reinforce_plus_plus",
            "algorithm.kl.coef=0.01",
            "algorithm.kl.use=reward",
        ],
        ["algorithm.opd_coef=0.5", "algorithm.teacher_model_path=policy_init"],
        [
            "algorithm.dynamic_sampling.enable=true",
            "algorithm.overlong.buffer=3",
            "algorithm.clip_ratio_high=0.28",
        ],
        ["algorithm.policy_loss=sapo", "algorithm.loss_params={tau_pos: 2.0, tau_neg: 2.5}"],
    ],
)
def test_possible_combinations_pass(overrides):
    load_config(None, [*BASE, *overrides])


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, "algorithm.advantage_estimator=gae", "algorithm.policy_loss=opd"])
    text = str(err.value)
    assert "algorithm.critic.enable" in text and "algorithm.teacher_model_path" in text


def test_teacher_directory_is_accepted(tmp_path):
    cfg = load_config(None, [*BASE, "algorithm.policy_loss=opd", f"algorithm.teacher_model_path={tmp_path}"])
    assert cfg.algorithm.teacher_model_path == str(tmp_path)


def test_plugin_names_get_only_generic_checks():
    """An estimator only a plugin knows may use a critic or a greedy baseline: no built-in rule applies."""
    algorithm = AlgorithmConfig(
        advantage_estimator="my_plugin_estimator",
        policy_loss="my_plugin_loss",
        critic=CriticConfig(enable=True),
        greedy_baseline=True,
        loss_params={"anything": 1},
        gamma=2.0,
    )
    cfg = RelaxConfig(rollout=RolloutConfig(n_samples_per_prompt=1), algorithm=algorithm)
    assert algorithm_config_errors(cfg) == ["algorithm.gamma: must be in [0, 1], got 2.0"]


def _quickstart_recipes() -> list:
    """Examples that run on the quick-start task (GPU-scale ones point at real model dirs)."""
    import yaml

    return [
        p
        for p in sorted(EXAMPLES.glob("*.yaml"))
        if yaml.safe_load(p.read_text()).get("model", {}).get("path") is None
    ]


@pytest.mark.parametrize("path", _quickstart_recipes(), ids=lambda p: p.stem)
def test_every_quickstart_recipe_validates(path):
    cfg = load_config(path)
    # the generated task, or a data file shipped beside the recipes (quickstart_math)
    assert cfg.data.path is None or (EXAMPLES.parent / cfg.data.path).is_file(), cfg.data.path
