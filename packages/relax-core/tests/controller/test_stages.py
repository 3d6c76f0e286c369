"""Stage functions without Ray: DAPO filters and shaping, batch preparation for every estimator input."""

from __future__ import annotations

import pytest
import torch

from relax.core.config import load_config
from relax.core.controller import stages
from relax.core.data import Sample

BASE = ["rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4"]


def sample(
    group: int, index: int, reward: float, n_tokens: int = 2, score: float | None = None, **info
) -> Sample:
    s = Sample(prompt_ids=[5, 6, 7], group_id=group, index_in_group=index, response_ids=[9] * n_tokens)
    s.rollout_logprobs = [-1.0] * n_tokens
    s.reward = reward
    s.reward_info = {"score": reward if score is None else score, **info}
    return s


def test_drop_uniform_groups_keeps_groups_that_disagree():
    groups = [
        [sample(0, 0, 1.0), sample(0, 1, 1.0)],
        [sample(1, 0, 0.0), sample(1, 1, 1.0)],
        [sample(2, 0, 0.0), sample(2, 1, 0.0)],
        [sample(3, 0, 0.5), sample(3, 1, 0.5), sample(3, 2, 1.0)],
    ]
    kept, dropped = stages.drop_uniform_groups(groups)
    assert [g[0].group_id for g in kept] == [1, 3] and dropped == 2
    assert stages.drop_uniform_groups([]) == ([], 0)


def test_drop_uniform_groups_metric_choice():
    """Both correct, one shaped by the overlong penalty: same score, different final reward."""
    group = [sample(0, 0, 1.0, score=1.0), sample(0, 1, 0.5, score=1.0)]
    assert stages.drop_uniform_groups([group], "score") == ([], 1)
    assert stages.drop_uniform_groups([group], "reward") == ([group], 0)
    with pytest.raises(KeyError, match="algorithm.dynamic_sampling.metric: reward_info has no 'acc'"):
        stages.drop_uniform_groups([group], "acc")


def test_filter_groups_applies_dynamic_sampling_only_when_configured():
    groups = [[sample(0, 0, 1.0), sample(0, 1, 1.0)], [sample(1, 0, 0.0), sample(1, 1, 1.0)]]
    assert stages.filter_groups(groups) == (groups, 0)
    cfg = load_config(None, [*BASE, "algorithm.dynamic_sampling.enable=true"])
    assert stages.filter_groups(groups, cfg) == ([groups[1]], 1)


def test_shape_rewards_adds_the_overlong_penalty():
    cfg = load_config(None, [*BASE, "algorithm.overlong.buffer=2", "algorithm.overlong.penalty_factor=0.5"])
    samples = [sample(0, i, 1.0, n_tokens=n) for i, n in enumerate([1, 2, 3, 4])]
    stages.shape_rewards(samples, cfg)
    # expected length 4 - 2 = 2: 0 up to 2 tokens, then -(len - 2) / 2, times 0.5
    assert [s.reward for s in samples] == [1.0, 1.0, 0.75, 0.5]
    assert [s.reward_info["overlong_penalty"] for s in samples] == [0.0, 0.0, -0.25, -0.5]
    assert all(s.reward_info["score"] == 1.0 for s in samples)
    metrics = stages.sample_metrics(samples)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.1875)
    assert metrics["reward/overlong_frac"] == 0.5
    assert metrics["reward/accuracy"] == 1.0  # from the task score, not the shaped reward

    untouched = [sample(0, 0, 1.0, n_tokens=4)]
    stages.shape_rewards(untouched, load_config(None, BASE))
    assert untouched[0].reward == 1.0 and "overlong_penalty" not in untouched[0].reward_info


def test_score_shapes_what_the_reward_role_scored():
    """The stage, not the role, applies the overlong penalty: the same for a reward scored in the
    driver as in an actor, and the role itself returns the task score untouched."""
    from relax.core.controller.contexts import reward_context
    from relax.core.controller.driver_reward import start_reward
    from relax.core.controller.local import get

    cfg = load_config(None, [*BASE, "algorithm.overlong.buffer=2", "algorithm.overlong.penalty_factor=0.5"])
    reward = start_reward(cfg, reward_context(cfg, None))  # numeric, declared in_driver: a local handle

    def fresh() -> list[Sample]:  # two correct answers, 1 and 4 tokens long
        return [
            Sample(
                prompt_ids=[5],
                group_id=0,
                index_in_group=i,
                response_ids=[9] * n,
                response_text="7",
                label="7",
            )
            for i, n in enumerate([1, 4])
        ]

    raw, _ = get(reward.score.remote(fresh()))
    assert [s.reward for s in raw] == [1.0, 1.0] and all("overlong_penalty" not in s.reward_info for s in raw)
    scored, stats = stages.score(reward, fresh(), cfg)
    assert [s.reward for s in scored] == [1.0, 0.5]
    assert [s.reward_info["overlong_penalty"] for s in scored] == [0.0, -0.5] and stats["failures"] == 0.0


def _old_logprobs(samples, value=-1.25):
    r_len = max(len(s.response_ids) for s in samples)
    mask = torch.tensor(
        [[1.0] * len(s.response_ids) + [0.0] * (r_len - len(s.response_ids)) for s in samples]
    )
    return value * mask


def test_prepare_batch_gae_uses_critic_values():
    cfg = load_config(None, [*BASE, "algorithm.advantage_estimator=gae", "algorithm.critic.enable=true"])
    samples = [sample(0, 0, 1.0, n_tokens=3), sample(0, 1, 0.0, n_tokens=2)]
    values = torch.tensor([[0.5, 0.25, 0.125], [0.5, 0.5, 0.0]])
    batch, metrics = stages.prepare_batch(samples, 0, cfg, _old_logprobs(samples), None, values=values)
    torch.testing.assert_close(batch["values"], values)
    # gamma = lam = 1: returns = A + V = reward-to-go = the sequence reward on every valid token
    torch.testing.assert_close(batch["returns"], torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    raw_adv = torch.tensor([0.5, 0.75, 0.875, -0.5, -0.5])
    expected = (raw_adv - raw_adv.mean()) / (raw_adv.std() + 1e-8)
    torch.testing.assert_close(batch["advantages"][batch["response_mask"] > 0], expected, atol=1e-5, rtol=0)
    assert metrics["critic/values_mean"] == pytest.approx(1.875 / 5)


def test_prepare_batch_remax_reads_the_greedy_reward():
    cfg = load_config(
        None,
        [
            *BASE,
            "rollout.n_samples_per_prompt=1",
            "algorithm.advantage_estimator=remax",
            "algorithm.greedy_baseline=true",
        ],
    )
    samples = [sample(0, 0, 1.0, greedy_reward=0.25), sample(1, 0, 0.0, greedy_reward=1.0)]
    batch, metrics = stages.prepare_batch(samples, 0, cfg, _old_logprobs(samples), None)
    torch.testing.assert_close(batch["advantages"], torch.tensor([[0.75, 0.75], [-1.0, -1.0]]))
    assert metrics["reward/greedy_mean"] == 0.625


def test_prepare_batch_carries_teacher_ref_and_rollout_logprobs_with_mismatch_metrics():
    cfg = load_config(
        None,
        [
            *BASE,
            "algorithm.opd_coef=0.1",
            "algorithm.teacher_model_path=policy_init",
            "algorithm.kl.coef=0.1",
        ],
    )
    samples = [sample(0, 0, 1.0), sample(0, 1, 0.0)]
    old = _old_logprobs(samples)  # rollout logprobs are -1.0: |diff| = 0.25 on every token
    teacher, ref = old - 0.5, old + 0.25
    batch, metrics = stages.prepare_batch(samples, 0, cfg, old, ref, teacher_logprobs=teacher)
    assert {"teacher_logprobs", "ref_logprobs", "rollout_logprobs", "old_logprobs"} <= set(batch)
    assert metrics["rollout/train_logprob_abs_diff"] == pytest.approx(0.25)
    assert metrics["rollout/train_k3_kl"] == pytest.approx(
        float(torch.exp(torch.tensor(-0.25)) + 0.25 - 1), rel=1e-5
    )
    assert metrics["kl/policy_teacher"] == pytest.approx(0.5)
    assert metrics["kl/policy_ref"] > 0
