"""Interior mask holes (issue 26): advantage estimators, KL reward shaping and loss aggregation.

A multi-turn response is ``[turn 1, mask 1][observation, mask 0][turn 2, mask 1]...``. For every
estimator in the registry (a newly registered one is covered automatically) and every aggregation
mode: nothing at a masked position changes a result (garbage, huge and non-finite values there give
bit-identical outputs), and a hole is transparent (the batch with holes gives what the same tokens
give packed contiguously: recursions bootstrap from the next *generated* token, discounts count
generated tokens, normalisers count unmasked tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.core.algorithms import (
    AGG_MODES,
    AdvantageInputs,
    AlgorithmConfig,
    KLConfig,
    aggregate_loss,
    apply_kl_penalty,
    compute_advantages,
    list_advantage_estimators,
    list_kl_estimators,
)

F64 = torch.float64
# three turns; two turns then padding; one turn; one-token holes; an empty row (a data-parallel pad); two turns
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 1, 1, 0, 1, 1],
        [1, 1, 0, 0, 0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 1, 1, 0],
    ],
    dtype=F64,
)
INDEX = torch.tensor([0, 0, 0, 1, 1, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.3, -0.5], dtype=F64)
#: position-wise by design: verl's OTB shares a baseline per absolute position (for multi-turn
#: responses verl and Relax offer ``tir_optimal_token_baseline``, which counts generated tokens)
ABSOLUTE_POSITION = {"optimal_token_baseline"}
TOKEN_FIELDS = ("values", "token_level_rewards", "old_logprobs", "ref_logprobs", "sum_pi_squared")


def garbage(shape: torch.Size, kind: str, seed: int = 7) -> torch.Tensor:
    """What a producer may leave at masked positions: huge finite values, or NaN/inf."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "huge":
        return 1e4 * (2 * torch.rand(shape, generator=gen, dtype=F64) - 1)
    pattern = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38], dtype=F64)
    return pattern[torch.randint(len(pattern), shape, generator=gen)]


def at_masked(x: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, fill)


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's unmasked entries moved to the front (order kept), zeros after: the holes closed."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        valid = x[row][mask[row] > 0]
        out[row, : valid.numel()] = valid
    return out


def compact_mask(mask: torch.Tensor) -> torch.Tensor:
    lengths = (mask > 0).sum(dim=-1, keepdim=True)
    return (torch.arange(mask.shape[-1]) < lengths).to(mask.dtype)


def estimator_inputs(dense: bool, seed: int = 0) -> AdvantageInputs:
    """Every field any built-in estimator reads, masked positions 0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(lo: float, hi: float) -> torch.Tensor:
        return (lo + (hi - lo) * torch.rand(MASK.shape, generator=gen, dtype=F64)) * MASK

    return AdvantageInputs(
        rewards=REWARDS,
        response_mask=MASK,
        index=INDEX,
        values=rand(-1, 1),
        token_level_rewards=rand(-0.5, 1) if dense else None,
        old_logprobs=rand(-3, -0.05),
        ref_logprobs=rand(-3, -0.05),
        kl_coef=0.05,
        greedy_rewards=torch.tensor([0.5, 0.5, 0.5, 0.2, 0.2, 0.2], dtype=F64),
        sum_pi_squared=rand(0.1, 0.9),
    )


def with_garbage(inputs: AdvantageInputs, kind: str) -> AdvantageInputs:
    mask = inputs.response_mask
    changes = {
        name: at_masked(getattr(inputs, name), mask, garbage(mask.shape, kind, seed=i))
        for i, name in enumerate(TOKEN_FIELDS)
        if getattr(inputs, name) is not None
    }
    return dataclasses.replace(inputs, **changes)


def compacted(inputs: AdvantageInputs) -> AdvantageInputs:
    mask = inputs.response_mask
    changes = {
        name: compact(getattr(inputs, name), mask)
        for name in TOKEN_FIELDS
        if getattr(inputs, name) is not None
    }
    return dataclasses.replace(inputs, response_mask=compact_mask(mask), **changes)


def advantages(name: str, inputs: AdvantageInputs, **cfg) -> tuple[torch.Tensor, torch.Tensor]:
    algorithm = AlgorithmConfig(advantage_estimator=name, **{"gamma": 0.9, "lam": 0.8, **cfg})
    return compute_advantages(algorithm, inputs)


# ------------------------------------------------------------------------- every estimator
@pytest.mark.parametrize("kind", ["huge", "nonfinite"])
@pytest.mark.parametrize("dense", [False, True], ids=["outcome", "token_rewards"])
@pytest.mark.parametrize("name", list_advantage_estimators())
def test_estimator_ignores_what_is_at_masked_positions(name, dense, kind):
    clean = estimator_inputs(dense)
    adv, returns = advantages(name, clean)
    dirty_adv, dirty_returns = advantages(name, with_garbage(clean, kind))
    for got, want, what in ((dirty_adv, adv, "advantages"), (dirty_returns, returns, "returns")):
        assert torch.isfinite(got).all(), f"{name}: non-finite {what} from garbage at masked positions"
        assert torch.equal(got, want), f"{name}: {what} changed with what is at masked positions"
        assert torch.count_nonzero(got[MASK == 0]) == 0, f"{name}: {what} not zero at masked positions"
    assert torch.count_nonzero(adv[MASK > 0]) > 0, f"{name}: all-zero advantages prove nothing"


@pytest.mark.parametrize("dense", [False, True], ids=["outcome", "token_rewards"])
@pytest.mark.parametrize("name", [n for n in list_advantage_estimators() if n not in ABSOLUTE_POSITION])
def test_estimator_sees_through_holes(name, dense):
    """The holed batch and the same tokens packed without holes give the same advantages and returns."""
    holed = estimator_inputs(dense)
    adv, returns = advantages(name, holed)
    packed_adv, packed_returns = advantages(name, compacted(holed))
    torch.testing.assert_close(compact(adv, MASK), packed_adv, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(compact(returns, MASK), packed_returns, atol=1e-10, rtol=1e-10)


def test_absolute_position_estimators_do_see_holes():
    """The exemption above is real: OTB differs once holes shift positions, and its TIR variant is the one
    that does not (checked for every estimator by the test above)."""
    holed = estimator_inputs(dense=False)
    adv, _ = advantages("optimal_token_baseline", holed)
    packed, _ = advantages("optimal_token_baseline", compacted(holed))
    assert not torch.allclose(compact(adv, MASK), packed)


@pytest.mark.parametrize("estimator", list_kl_estimators())
def test_kl_reward_shaping_ignores_masked_positions_and_sees_through_holes(estimator):
    """``kl.use="reward"``: the per-token KL penalty of every estimator, through a token-level estimator."""
    clean = estimator_inputs(dense=True)
    kw = {"kl": KLConfig(coef=0.2, estimator=estimator, use="reward")}
    adv, returns = advantages("reinforce_plus_plus", clean, **kw)
    dirty_adv, dirty_returns = advantages("reinforce_plus_plus", with_garbage(clean, "nonfinite"), **kw)
    assert torch.equal(dirty_adv, adv) and torch.equal(dirty_returns, returns)
    plain, _ = advantages("reinforce_plus_plus", clean)
    assert not torch.allclose(adv, plain), (
        "the KL penalty must change something for this test to mean anything"
    )
    packed, _ = advantages("reinforce_plus_plus", compacted(clean), **kw)
    torch.testing.assert_close(compact(adv, MASK), packed, atol=1e-10, rtol=1e-10)

    rewards = clean.token_level_rewards
    shaped, metrics = apply_kl_penalty(rewards, clean.old_logprobs, clean.ref_logprobs, MASK, 0.2, estimator)
    dirty = with_garbage(clean, "huge")
    got, got_metrics = apply_kl_penalty(rewards, dirty.old_logprobs, dirty.ref_logprobs, MASK, 0.2, estimator)
    assert torch.equal(got, shaped) and got_metrics == metrics
    packed_shaped, packed_metrics = apply_kl_penalty(
        compact(rewards, MASK),
        compact(clean.old_logprobs, MASK),
        compact(clean.ref_logprobs, MASK),
        compact_mask(MASK),
        0.2,
        estimator,
    )
    torch.testing.assert_close(compact(shaped, MASK), packed_shaped, atol=1e-12, rtol=0)
    assert packed_metrics["reward_kl"] == pytest.approx(metrics["reward_kl"], abs=1e-12)


# ---------------------------------------------------------------- token-level recursions by hand
def test_gae_bootstraps_the_last_token_of_a_turn_from_the_first_token_of_the_next():
    # turn 1 = t0, t1; observation t2, t3 (values there are garbage); turn 2 = t4. lam = 0: A_t = delta_t,
    # so the return of t1 is r_1 + gamma * V(t4), never gamma * V(t2) nor gamma^3 * V(t4)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64),
        response_mask=torch.tensor([[1, 1, 0, 0, 1]], dtype=F64),
        index=torch.tensor([0]),
        values=torch.tensor([[0.3, 0.6, 1e4, -1e4, 0.8]], dtype=F64),
    )
    _, returns = advantages("gae", inputs, lam=0.0)
    assert returns[0].tolist() == pytest.approx([0.9 * 0.6, 0.9 * 0.8, 0.0, 0.0, 1.0])
    # lam = 1: the Monte-Carlo return, discounted over generated tokens only (2 steps from t0 to t4, not 4)
    _, returns = advantages("gae", inputs, lam=1.0)
    assert returns[0].tolist() == pytest.approx([0.9**2, 0.9, 0.0, 0.0, 1.0])


def verl_gae_returns(rewards, values, mask, gamma, lam):
    """verl's multi-turn GAE recursion (``compute_gae_advantage_return``: "skip values and TD-error on
    observation tokens"), written out from its formula: the next value and the running advantage are
    carried unchanged across masked tokens."""
    next_value = last = torch.zeros(mask.shape[0], dtype=F64)
    out = []
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        candidate = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
        next_value = values[:, t] * m + (1 - m) * next_value
        last = candidate * m + (1 - m) * last
        out.append(last)
    return torch.stack(out[::-1], dim=1) + values


@pytest.mark.parametrize("dense", [False, True], ids=["outcome", "token_rewards"])
def test_gae_matches_verls_multi_turn_recursion_on_holed_rows(dense):
    from relax.core.algorithms.advantages import token_rewards

    inputs = estimator_inputs(dense)
    _, returns = advantages("gae", inputs)
    expected = verl_gae_returns(token_rewards(inputs), inputs.values, MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns[MASK > 0], expected[MASK > 0], atol=1e-12, rtol=0)


def test_discounted_returns_count_generated_tokens_only():
    # verl's REINFORCE++ resets the running return at every masked token (written for trailing padding),
    # which would cut turn 1 off the outcome reward; here it is carried across the hole, as GAE does
    inputs = AdvantageInputs(
        rewards=torch.tensor([2.0], dtype=F64),
        response_mask=torch.tensor([[1, 0, 0, 0, 1, 1]], dtype=F64),
        index=torch.tensor([0]),
    )
    _, returns = advantages("reinforce_plus_plus", inputs)
    assert returns[0].tolist() == pytest.approx([2 * 0.9**2, 0, 0, 0, 2 * 0.9, 2.0])


def test_the_outcome_reward_lands_on_the_last_generated_token():
    # the trajectory ends with an observation (e.g. the episode was cut after a tool result)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64),
        response_mask=torch.tensor([[1, 1, 0, 1, 0, 0]], dtype=F64),
        index=torch.tensor([0]),
    )
    _, returns = advantages("reinforce_plus_plus", inputs, gamma=1.0)
    assert returns[0].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------- aggregation
# row 0: turn (1, 2, 3), observation (100), turn (4); row 1: turn (5), observation (NaN), turn (7), padding
AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0, 100.0, 4.0], [5.0, float("nan"), 7.0, 1e30, -1e30]], dtype=F64)
AGG_MASK = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 1, 0, 0]], dtype=F64)
BY_HAND = {
    "token-sum": 22.0,
    "token-mean": 22.0 / 6,  # 6 unmasked tokens, not 9 spanned
    "seq-mean-token-sum": (10.0 + 12.0) / 2,
    "seq-mean-token-mean": (10.0 / 4 + 12.0 / 2)
    / 2,  # each row by its unmasked count (4, 2), not its span (5, 3)
    "seq-mean-token-sum-norm": (10.0 / 5 + 12.0 / 5)
    / 2,  # Dr. GRPO: a constant (the padded width), by design
}


def test_every_aggregation_mode_has_a_hand_computed_value():
    assert set(BY_HAND) == set(AGG_MODES), "a new loss_agg_mode needs its hand-computed value here"


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_counts_unmasked_tokens_and_ignores_masked_values(mode):
    values = AGG_VALUES.clone().requires_grad_(True)
    loss = aggregate_loss(values, AGG_MASK, mode)
    assert loss.item() == pytest.approx(BY_HAND[mode], rel=1e-12)
    loss.backward()
    assert torch.isfinite(values.grad).all() and torch.count_nonzero(values.grad[AGG_MASK == 0]) == 0
    packed = aggregate_loss(compact(torch.nan_to_num(AGG_VALUES), AGG_MASK), compact_mask(AGG_MASK), mode)
    assert packed.item() == pytest.approx(loss.item(), rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_with_global_counts_splits_holed_rows_exactly(mode):
    """Micro-batches of holed rows with the step's global counts add up to the full-batch value."""
    counts = {"global_token_count": float(AGG_MASK.sum()), "global_seq_count": 2.0}
    whole = aggregate_loss(AGG_VALUES, AGG_MASK, mode, **counts)
    parts = sum(aggregate_loss(AGG_VALUES[i : i + 1], AGG_MASK[i : i + 1], mode, **counts) for i in range(2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
