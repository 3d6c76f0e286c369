"""Optimal token baselines: hand-computed values, and agreement with verl's formulas (a loop over
groups and positions written from verl's ``compute_optimal_token_baseline_advantage`` /
``compute_multi_turn_optimal_token_baseline_advantage``) on ragged batches with non-contiguous
groups, singletons, all-masked rows and interior observation holes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.core.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs

F64 = torch.float64


def inputs(mask, rewards, index, pi=0.5, sum_sq=0.5):
    mask = torch.tensor(mask, dtype=F64)
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=F64),
        response_mask=mask,
        index=torch.tensor(index),
        old_logprobs=torch.full_like(mask, pi).log(),
        sum_pi_squared=torch.full_like(mask, sum_sq),
    )


def test_otb_hand_computed_with_zero_tail():
    # rewards on the last valid token: G = [[1, 1], [0, 0]]; w = 1 - 2(.5) + .5 = .5, W = [[.5, 1], [.5, .5]]
    # B_0 = (1 * .5 + 0 * .5) / 1 = .5; t=1 only row 0 is valid: B_1 = 1 * 1 / 1 = 1
    batch = inputs([[1, 1], [1, 0]], [1.0, 0.0], [4, 4])
    adv, ret = ADVANTAGE_ESTIMATORS["optimal_token_baseline"](batch, handle_zero_tail=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0], [-0.5, 0.0]], dtype=F64), atol=1e-7, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64))
    # zero tail: row 0 is the one longest response, so from the second-longest length (1) on it has no baseline
    adv, _ = ADVANTAGE_ESTIMATORS["optimal_token_baseline"](batch)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0], [-0.5, 0.0]], dtype=F64), atol=1e-7, rtol=0)


def test_tir_aligns_generated_tokens_across_observation_holes():
    # row 0 has an observation token at t=1; row 1 is right-padded. Both have 2 generated tokens.
    batch = inputs([[1, 0, 1], [1, 1, 0]], [1.0, 0.0], [0, 0])
    # TIR: k-th generated tokens share B_k; W row0 = [.5, 1], row1 = [.5, 1] -> B = [.5, .5]
    adv, _ = ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"](batch)
    torch.testing.assert_close(
        adv, torch.tensor([[0.5, 0, 0.5], [-0.5, -0.5, 0]], dtype=F64), atol=1e-7, rtol=0
    )
    # OTB: absolute positions; t=1 and t=2 each have one valid response, whose baseline is its own return
    adv, _ = ADVANTAGE_ESTIMATORS["optimal_token_baseline"](batch)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0, 0], [-0.5, 0, 0]], dtype=F64), atol=1e-7, rtol=0)


def test_singletons_all_masked_rows_and_missing_inputs():
    batch = inputs([[1, 1], [0, 0], [1, 0]], [2.0, 5.0, 1.0], [0, 1, 1])
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, ret = ADVANTAGE_ESTIMATORS[name](batch)
        assert adv[0].tolist() == [2.0, 2.0]  # singleton: no baseline
        assert adv[1].tolist() == [0.0, 0.0] and ret[1].tolist() == [0.0, 0.0]  # all masked
    # OTB counts the all-masked row as a member of group 1 (as verl): row 2 is its unique longest
    # response, so zero tail leaves it without baseline; TIR does not count it: row 2 is a singleton
    assert ADVANTAGE_ESTIMATORS["optimal_token_baseline"](batch)[0][2, 0].item() == 1.0
    assert ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"](batch)[0][2, 0].item() == 1.0
    no_otb = AdvantageInputs(rewards=batch.rewards, response_mask=batch.response_mask, index=batch.index)
    with pytest.raises(ValueError, match="old_logprobs and inputs.sum_pi_squared"):
        ADVANTAGE_ESTIMATORS["optimal_token_baseline"](no_otb)


# ---------------------------------------------------------------- verl's formulas, written as loops


def _verl_groups(index, rows):
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(int(index[i]), []).append(i)
    return groups


def _zero_tail(baseline_rows, lengths, members):
    ordered = sorted(lengths[i] for i in members)
    longest = [i for i in members if lengths[i] == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        baseline_rows[longest[0]][ordered[-2] :] = 0.0


def verl_otb(r, m, index, lp, sq, zero_tail, eps=1e-8):
    b, t = m.shape
    g = (r * m).flip(-1).cumsum(-1).flip(-1)
    w = ((1 - 2 * lp.exp() + sq) * m).cumsum(-1)
    base = torch.zeros_like(g)
    lengths = [int(x) for x in m.sum(-1)]
    for members in _verl_groups(index, range(b)).values():
        if len(members) == 1:
            continue
        for s in range(t):
            num = sum(float(g[i, s] * w[i, s] * m[i, s]) for i in members)
            den = sum(float(w[i, s] * m[i, s]) for i in members) + eps
            for i in members:
                base[i, s] = num / den
        if zero_tail:
            _zero_tail(base, lengths, members)
    return (g - base) * m


def verl_tir(r, m, index, lp, sq, zero_tail, eps=1e-8):
    b, t = m.shape
    g = (r * m).flip(-1).cumsum(-1).flip(-1)
    w = ((1 - 2 * lp.exp() + sq) * m).cumsum(-1)
    lengths = [int(x) for x in m.sum(-1)]
    width = max(lengths, default=0)
    cw, cg = torch.zeros(b, width, dtype=F64), torch.zeros(b, width, dtype=F64)
    for i in range(b):
        cw[i, : lengths[i]], cg[i, : lengths[i]] = w[i, m[i] > 0], g[i, m[i] > 0]
    base = torch.zeros_like(cg)
    for members in _verl_groups(index, [i for i in range(b) if lengths[i]]).values():
        if len(members) == 1:
            continue
        rows = torch.tensor(members)
        base[rows] = (cg[rows] * cw[rows]).sum(0) / (cw[rows].sum(0) + eps)
        if zero_tail:
            _zero_tail(base, lengths, members)
    adv = torch.zeros_like(g)
    for i in range(b):
        adv[i, m[i] > 0] = cg[i, : lengths[i]] - base[i, : lengths[i]]
    return adv


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 7)), draw(st.integers(1, 6))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))  # holes, empty rows, any layout
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    index = torch.tensor(draw(st.lists(st.sampled_from([3, 9, 1]), min_size=b, max_size=b)))  # non-contiguous
    mask = torch.tensor(bits, dtype=F64).reshape(b, t)
    return (
        torch.randn(b, t, generator=gen, dtype=F64) * mask,  # token-level rewards
        mask,
        index,
        -torch.rand(b, t, generator=gen, dtype=F64) * 3,
        torch.rand(b, t, generator=gen, dtype=F64),
        draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(batches())
def test_matches_verl_formulas(batch):
    r, m, index, lp, sq, zero_tail = batch
    inputs_ = AdvantageInputs(
        rewards=torch.zeros(m.shape[0], dtype=F64),
        response_mask=m,
        index=index,
        token_level_rewards=r,
        old_logprobs=lp,
        sum_pi_squared=sq,
    )
    for name, reference in [("optimal_token_baseline", verl_otb), ("tir_optimal_token_baseline", verl_tir)]:
        adv, ret = ADVANTAGE_ESTIMATORS[name](inputs_, handle_zero_tail=zero_tail)
        torch.testing.assert_close(adv, reference(r, m, index, lp, sq, zero_tail), msg=name)
        torch.testing.assert_close(ret, (r * m).flip(-1).cumsum(-1).flip(-1) * m, msg=name)
