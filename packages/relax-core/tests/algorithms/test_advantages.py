"""Advantage estimators: reference values, group edge cases, and properties on ragged masks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.core.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, last_token_rewards

F64 = torch.float64
# 6 responses; groups 7 = rows {0, 1, 3}, 3 = {2} (singleton), 5 = {4, 5} (zero variance).
MASK = torch.tensor(
    [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=F64
)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.2, 0.2], dtype=F64)
INDEX = torch.tensor([7, 7, 3, 7, 5, 5])
BASE = AdvantageInputs(rewards=REWARDS, response_mask=MASK, index=INDEX)
VALUES = torch.tensor(
    [
        [0.1, 0.2, 0.3, 9.0],
        [0.5, -0.1, 9.0, 9.0],
        [0.0, 0.1, 0.2, 0.3],
        [0.4, 9, 9, 9],
        [0.3, 0.3, 9, 9],
        [-0.2, 0.1, 0.05, 9],
    ],
    dtype=F64,
)


def run(name, inputs=BASE, **params):
    return ADVANTAGE_ESTIMATORS[name](inputs, **params)


# Reference values computed from verl's formulas (verl/trainer/ppo/core_algos.py at
# volcengine/verl@b178a3cd) on the batch above, rewards placed on the last valid token.
@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("grpo", {}, [0.577349, -1.154699, 0.5, 0.577349, 0.0, 0.0]),
        ("grpo", {"norm_adv_by_std": False}, [1 / 3, -2 / 3, 0.5, 1 / 3, 0.0, 0.0]),
        ("dr_grpo", {}, [1 / 3, -2 / 3, 0.5, 1 / 3, 0.0, 0.0]),
        ("rloo", {}, [0.5, -1.0, 0.5, 0.5, 0.0, 0.0]),
        ("gpg", {}, [0.4, -0.8, 0.6, 0.4, 0.0, 0.0]),
        ("reinforce_plus_plus_baseline", {}, [0.520546, -2.082182, 0.954334, 0.520546, -0.347030, -0.347030]),
    ],
)
def test_outcome_estimators_match_verl(name, params, expected):
    adv, returns = run(name, **params)
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected, dtype=F64), atol=1e-6, rtol=0)
    assert torch.equal(adv, returns)
    assert torch.all(adv[MASK == 0] == 0)
    assert torch.all(adv == adv[:, :1] * MASK)  # one value per sequence, broadcast over valid tokens


def test_grpo_hand_computed():
    # group {1, 0, 1}: mean 2/3, unbiased std sqrt(1/3); singleton: r / (1 + eps); equal group: 0
    adv, _ = run("grpo")
    std = (1 / 3) ** 0.5
    assert adv[0, 0].item() == pytest.approx((1 - 2 / 3) / (std + 1e-6))
    assert adv[1, 0].item() == pytest.approx((0 - 2 / 3) / (std + 1e-6))
    assert adv[2, 0].item() == pytest.approx(0.5 / (1 + 1e-6))
    assert adv[4, 0].item() == 0.0 and adv[5, 0].item() == 0.0


def test_zero_variance_group_is_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7], dtype=F64)  # 0.1 * 3 has float noise in its mean
    inputs = AdvantageInputs(
        rewards=rewards, response_mask=torch.ones(5, 2, dtype=F64), index=torch.tensor([0, 0, 0, 1, 1])
    )
    for name in ("grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"):
        adv, _ = run(name, inputs)
        assert torch.count_nonzero(adv) == 0, name


def test_opo_length_weighted_baseline():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64), response_mask=mask, index=torch.tensor([4, 4])
    )
    adv, _ = run("opo", inputs)  # b = (3 * 1 + 1 * 0) / 4
    assert adv[0, 0].item() == pytest.approx(0.25) and adv[1, 0].item() == pytest.approx(-0.75)


def test_grpo_passk_matches_verl_and_handles_singletons():
    inputs = dataclasses.replace(
        BASE,
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.3, 0.2, 0.9], dtype=F64),
        index=torch.tensor([7, 7, 5, 7, 5, 5]),
    )
    adv, _ = run("grpo_passk", inputs)  # verl reference values
    torch.testing.assert_close(
        adv[:, 0], torch.tensor([1.364094, 0, 0, 0, 0, 1.138986], dtype=F64), atol=1e-6, rtol=0
    )
    adv, _ = run("grpo_passk", inputs, norm_adv_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.7, 0, 0, 0, 0, 0.4], dtype=F64))
    adv, _ = run("grpo_passk")  # row 2 is a singleton: 0 (verl raises)
    assert adv[2].abs().sum() == 0


def test_reinforce_plus_plus_matches_verl():
    adv, returns = run("reinforce_plus_plus", gamma=0.9)
    torch.testing.assert_close(returns[2], torch.tensor([0.3645, 0.405, 0.45, 0.5], dtype=F64))
    torch.testing.assert_close(returns[0], torch.tensor([0.81, 0.9, 1.0, 0.0], dtype=F64))
    torch.testing.assert_close(
        adv[0], torch.tensor([1.1102880, 1.3687840, 1.6560017, 0.0], dtype=F64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        adv[5, :3], torch.tensor([-0.7508829, -0.6991837, -0.6417402], dtype=F64), atol=1e-6, rtol=0
    )


def test_reinforce_plus_plus_kl_shaping_matches_verl():
    old = torch.tensor([[-1.0, -0.5, -2.0, -1.0]] * 6, dtype=F64)
    ref = torch.tensor([[-1.2, -0.4, -1.5, -3.0]] * 6, dtype=F64)
    inputs = dataclasses.replace(BASE, old_logprobs=old, ref_logprobs=ref, kl_coef=0.1)
    adv, returns = run("reinforce_plus_plus", inputs)
    # verl: compute_rewards(scores, old, ref, 0.1) then reinforce_plus_plus with gamma=1
    torch.testing.assert_close(
        adv[0], torch.tensor([1.5576478, 1.6097430, 1.5836954, 0.0], dtype=F64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        adv[2], torch.tensor([-0.2656857, -0.2135905, -0.2396381, -0.3698762], dtype=F64), atol=1e-6, rtol=0
    )
    # hand: row 0 return at t=2 is r - 0.1 * (old - ref) = 1 - 0.1 * (-0.5)
    assert returns[0, 2].item() == pytest.approx(1.05)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run("reinforce_plus_plus", dataclasses.replace(BASE, kl_coef=0.1))


def test_reinforce_plus_plus_carries_the_return_across_an_observation_hole():
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        response_mask=torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=F64),
        index=torch.tensor([0, 1]),
    )
    _, returns = run("reinforce_plus_plus", inputs, gamma=0.9)
    assert returns[0].tolist() == pytest.approx([0.9, 0.0, 1.0])  # t=0 sees the reward after the hole


def _gdpo_batch(**components):
    # groups 0 = rows {0, 2}, 1 = rows {1, 3} (interleaved), one token per response
    return AdvantageInputs(
        rewards=torch.zeros(4, dtype=F64),
        response_mask=torch.ones(4, 1, dtype=F64),
        index=torch.tensor([0, 1, 0, 1]),
        reward_components={k: torch.tensor(v, dtype=F64) for k, v in components.items()},
    )


def test_gdpo_hand_computed():
    batch = _gdpo_batch(fmt=[1, 1, 0, 1], acc=[1, 0, 0, 0])
    # each component per group: fmt -> [+s, 0, -s, 0] (group 1 constant), acc -> [+s, 0, -s, 0], s = 1/sqrt2;
    # weighted sum [1.5 s, 0, -1.5 s, 0]; batch whitening (unbiased var 0.75) -> [+-sqrt(1.5), 0]
    adv, returns = run("gdpo", batch, reward_keys=["fmt", "acc"], reward_weights=[1.0, 0.5])
    expected = torch.tensor([[1.5**0.5], [0.0], [-(1.5**0.5)], [0.0]], dtype=F64)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert torch.equal(adv, returns)


def test_gdpo_normalises_each_reward_on_its_own():
    # group 1 (rows 1, 3): row 1 wins the small reward, row 3 the big one. Summed first (GRPO), the
    # big reward decides alone; decoupled, each counts once and the two responses tie.
    batch = _gdpo_batch(big=[10, 0, 0, 10], small=[1, 1, 0, 0])
    adv, _ = run("gdpo", batch, reward_keys=["big", "small"])
    torch.testing.assert_close(adv[[1, 3], 0], torch.zeros(2, dtype=F64), atol=1e-4, rtol=0)
    assert adv[0, 0] > 1 and adv[2, 0] < -1  # row 0 wins both in group 0
    summed, _ = run("grpo", dataclasses.replace(batch, rewards=torch.tensor([11.0, 1, 0, 10], dtype=F64)))
    assert summed[1, 0] < -0.5 and summed[3, 0] > 0.5


def test_gdpo_without_keys_is_whitened_grpo_and_errors_name_keys():
    from relax.core.algorithms import masked_whiten

    adv, _ = run("gdpo")  # BASE: non-contiguous groups, a singleton and a zero-variance group
    torch.testing.assert_close(adv, masked_whiten(run("grpo")[0], MASK))
    with pytest.raises(
        ValueError, match=r"reward_keys \['acc'\] are not reward components; available: \['fmt'\]"
    ):
        run("gdpo", _gdpo_batch(fmt=[1, 0, 1, 0]), reward_keys=["acc"])
    with pytest.raises(ValueError, match="1 reward_weights for 2 reward components"):
        run("gdpo", _gdpo_batch(a=[1, 0, 1, 0], b=[0, 0, 1, 1]), reward_keys=["a", "b"], reward_weights=[1.0])


def test_gae_matches_verl():
    adv, returns = run("gae", dataclasses.replace(BASE, values=VALUES), gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns[0], torch.tensor([0.59328, 0.774, 1.0, 0.0], dtype=F64))
    torch.testing.assert_close(returns[1], torch.tensor([-0.018, 0.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(
        adv[5], torch.tensor([0.3681553, -0.5064703, -0.1981454, 0.0], dtype=F64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        adv[1], torch.tensor([-2.3214551, -0.3570758, 0.0, 0.0], dtype=F64), atol=1e-6, rtol=0
    )


def test_gae_skips_observation_tokens():
    # valid, observation, valid, valid: the TD chain jumps over the observation token (verl: same returns)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64),
        response_mask=torch.tensor([[1, 0, 1, 1]], dtype=F64),
        index=torch.tensor([0]),
        values=torch.tensor([[0.2, 5.0, 0.1, 0.4]], dtype=F64),
    )
    _, returns = run("gae", inputs, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns, torch.tensor([[0.58824, 0.0, 0.792, 1.0]], dtype=F64))
    # gamma = lam = 1: every valid return is the final reward
    _, returns = run("gae", inputs)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64))


def test_remax_hand_computed():
    greedy = torch.tensor([0.5, 0.5, 0.0, 0.5, 1.0, 1.0], dtype=F64)
    adv, returns = run("remax", dataclasses.replace(BASE, greedy_rewards=greedy))
    torch.testing.assert_close(adv[:, 0], REWARDS - greedy)
    torch.testing.assert_close(adv, (REWARDS - greedy).unsqueeze(-1) * MASK)
    torch.testing.assert_close(returns, REWARDS.unsqueeze(-1) * MASK)
    with pytest.raises(ValueError, match="greedy_rewards"):
        run("remax")


def test_token_level_rewards_and_last_token_placement():
    placed = last_token_rewards(REWARDS, MASK)
    assert placed[0, 2] == 1.0 and placed[2, 3] == 0.5 and placed.sum() == REWARDS.sum()
    interleaved = last_token_rewards(torch.tensor([2.0]), torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]]))
    assert interleaved.tolist() == [[0.0, 0.0, 0.0, 2.0, 0.0]]
    tlr = torch.zeros(6, 4, dtype=F64)
    tlr[:, 0] = REWARDS  # same sequence scores, different placement: outcome estimators agree
    a1, _ = run("grpo")
    a2, _ = run("grpo", dataclasses.replace(BASE, token_level_rewards=tlr))
    torch.testing.assert_close(a1, a2)


def test_inputs_not_mutated():
    inputs = dataclasses.replace(
        BASE,
        values=VALUES.clone(),
        greedy_rewards=REWARDS.clone(),
        old_logprobs=-VALUES.abs(),
        sum_pi_squared=VALUES.abs() / 10,
        reward_components={"score": REWARDS.clone()},
    )
    snapshot = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    copies = {k: v.clone() for k, v in snapshot.items() if isinstance(v, torch.Tensor)}
    for name in ADVANTAGE_ESTIMATORS:
        run(name, inputs)
    for k, v in copies.items():
        assert torch.equal(getattr(inputs, k), v), k


# ---------------------------------------------------------------- properties on ragged masks

GROUP_ESTIMATORS = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus_baseline",
    "opo",
    "gpg",
    "grpo_passk",
    "gdpo",
)


@st.composite
def ragged_batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 5))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=F64).reshape(b, t)
    rewards = torch.tensor(
        draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]), min_size=b, max_size=b)), dtype=F64
    )
    index = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    token_rewards = torch.randn(b, t, generator=gen, dtype=F64) * mask if draw(st.booleans()) else None
    return AdvantageInputs(
        rewards=rewards,
        response_mask=mask,
        index=index,
        values=torch.randn(b, t, generator=gen, dtype=F64),
        token_level_rewards=token_rewards,
        old_logprobs=-torch.rand(b, t, generator=gen, dtype=F64) * 3,
        ref_logprobs=-torch.rand(b, t, generator=gen, dtype=F64) * 3,
        kl_coef=0.1,
        greedy_rewards=torch.randn(b, generator=gen, dtype=F64),
        sum_pi_squared=torch.rand(b, t, generator=gen, dtype=F64),
    ), gen


def _garbage(x, mask, gen):
    return torch.where(mask > 0, x, torch.randn(x.shape, generator=gen, dtype=x.dtype) * 50)


@settings(max_examples=40, deadline=None)
@given(ragged_batches())
def test_masked_positions_never_affect_results(batch):
    inputs, gen = batch
    m = inputs.response_mask
    tlr = inputs.token_level_rewards
    dirty = dataclasses.replace(
        inputs,
        token_level_rewards=None if tlr is None else _garbage(tlr, m, gen),
        values=_garbage(inputs.values, m, gen),
        old_logprobs=_garbage(inputs.old_logprobs, m, gen),
        ref_logprobs=_garbage(inputs.ref_logprobs, m, gen),
        sum_pi_squared=_garbage(inputs.sum_pi_squared, m, gen),
    )
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        clean_adv, clean_ret = fn(inputs)
        adv, ret = fn(dirty)
        torch.testing.assert_close(adv, clean_adv, msg=name)
        torch.testing.assert_close(ret, clean_ret, msg=name)
        assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0), name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name


@settings(max_examples=40, deadline=None)
@given(ragged_batches(), st.randoms(use_true_random=False))
def test_group_estimators_permutation_and_relabel_invariant(batch, rnd):
    inputs, _ = batch
    perm = list(range(inputs.rewards.numel()))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    tlr = inputs.token_level_rewards
    permuted = AdvantageInputs(
        rewards=inputs.rewards[perm],
        response_mask=inputs.response_mask[perm],
        index=inputs.index[perm] * 13 + 1000,
        token_level_rewards=None if tlr is None else tlr[perm],
    )
    for name in GROUP_ESTIMATORS:
        adv, _ = ADVANTAGE_ESTIMATORS[name](inputs)
        adv_p, _ = ADVANTAGE_ESTIMATORS[name](permuted)
        torch.testing.assert_close(adv_p, adv[perm], msg=name)
