"""Rollout/train mismatch corrections and DAPO helpers, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from relax.core.algorithms import dynamic_sampling_keep, masked_is, opsm_mask, overlong_penalty, truncated_is

F64 = torch.float64
TRAIN = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.3, -0.3, -9.0, -9.0]], dtype=F64)
ROLLOUT = torch.tensor([[-1.5, -0.5, -1.0, -0.1], [-0.2, -0.5, -0.1, -0.1]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
# valid log ratios: row 0 [0.5, 0, -1], row 1 [-0.1, 0.2]


def test_mismatch_metrics():
    _, m = truncated_is(TRAIN, ROLLOUT, MASK)
    diffs = [0.5, 0.0, -1.0, -0.1, 0.2]
    assert m["mismatch_abs_logprob_diff"] == pytest.approx(sum(abs(d) for d in diffs) / 5)
    assert m["mismatch_k3_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in diffs) / 5)


def test_truncated_is_levels():
    w, m = truncated_is(TRAIN, ROLLOUT, MASK, level="token", high=1.5)
    expected = [[1.5, 1.0, math.exp(-1.0), 0.0], [math.exp(-0.1), math.exp(0.2), 0.0, 0.0]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64))
    assert m["is_clip_frac"] == pytest.approx(1 / 5)
    w, _ = truncated_is(TRAIN, ROLLOUT, MASK, level="sequence", low=0.7, high=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.7, 0.7, 0.7, 0], [math.exp(0.1)] * 2 + [0, 0]], dtype=F64))
    w, _ = truncated_is(TRAIN, ROLLOUT, MASK, level="geometric")
    torch.testing.assert_close(w[0, :3], torch.full((3,), math.exp(-0.5 / 3), dtype=F64))
    torch.testing.assert_close(w[1, :2], torch.full((2,), math.exp(0.05), dtype=F64))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="level"):
        truncated_is(TRAIN, ROLLOUT, MASK, level="seq")


def test_masked_is_icepop():
    w, m = masked_is(TRAIN, ROLLOUT, MASK, level="token", low=0.5, high=1.5)
    # e^0.5 > 1.5 and e^-1 < 0.5 are dropped; the rest keep their ratio
    expected = [[0.0, 1.0, 0.0, 0.0], [math.exp(-0.1), math.exp(0.2), 0.0, 0.0]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64))
    assert m["is_mask_frac"] == pytest.approx(2 / 5)
    w, _ = masked_is(TRAIN, ROLLOUT, MASK, level="sequence", low=0.7, high=1.5)  # row 0: e^-0.5 < 0.7
    torch.testing.assert_close(w, torch.tensor([[0, 0, 0, 0], [math.exp(0.1)] * 2 + [0, 0]], dtype=F64))


def test_opsm():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=F64)
    behavior = torch.tensor(
        [[-0.5, -0.7], [-0.5, -0.7], [-0.95, -0.95], [-0.5, -0.7], [-0.5, 5.0]], dtype=F64
    )
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]], dtype=F64)
    keep, m = opsm_mask(lp, behavior, adv, mask, delta=0.1)
    # row 0: KL 0.4 > 0.1 and A < 0 -> dropped; row 1: A > 0 -> kept; row 2: KL 0.05 -> kept;
    # row 3: only the negative-advantage token; row 4: KL 0.5 from its valid token only -> dropped
    assert keep.tolist() == [[0, 0], [1, 1], [1, 1], [0, 1], [0, 0]]
    assert m["opsm_mask_frac"] == pytest.approx(4 / 9)


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    index = torch.tensor([10, 10, 3, 3, 42, 42, 8])
    assert dynamic_sampling_keep(rewards, index).tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    pen = overlong_penalty(lengths, max_len=20, buffer=4, penalty_factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=20, buffer=0)
