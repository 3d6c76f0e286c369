"""Loss aggregation modes: hand-computed values, empty rows, micro-batch accumulation == full batch."""

from __future__ import annotations

import pytest
import torch

from relax.core.algorithms.aggregation import (
    AGG_MODES,
    aggregate_loss,
    masked_mean,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor(
    [[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0], [7.0, 100.0, 100.0, 100.0]], dtype=torch.float64
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5 + 7) / 6),
        ("token-sum", 22.0),
        ("seq-mean-token-sum", (6 + 9 + 7) / 3),
        ("seq-mean-token-mean", (2 + 4.5 + 7) / 3),
        ("seq-mean-token-sum-norm", (6 + 9 + 7) / 4 / 3),
    ],
)
def test_modes_hand_computed(mode, expected):
    assert aggregate_loss(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_scale_factor_and_global_counts():
    assert aggregate_loss(
        VALUES, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10
    ).item() == pytest.approx(22 / 10 / 3)
    assert aggregate_loss(VALUES, MASK, "token-mean", global_token_count=11).item() == pytest.approx(2.0)
    assert aggregate_loss(VALUES, MASK, "seq-mean-token-mean", global_seq_count=6).item() == pytest.approx(
        13.5 / 6
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_rows_excluded_and_no_nan(mode):
    mask = MASK.clone()
    mask[1] = 0
    with_empty = aggregate_loss(VALUES, mask, mode)
    without = aggregate_loss(VALUES[[0, 2]], mask[[0, 2]], mode)
    assert torch.isfinite(with_empty)
    assert with_empty.item() == pytest.approx(without.item())
    assert aggregate_loss(VALUES, torch.zeros_like(MASK), mode).item() == 0.0


def test_masked_positions_can_hold_inf():
    values = VALUES.clone()
    values[MASK == 0] = float("inf")
    for mode in AGG_MODES:
        assert torch.isfinite(aggregate_loss(values, MASK, mode))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_accumulation_equals_full_batch(mode):
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.35).to(torch.float64)
    mask[4] = 0  # an empty row in one micro-batch
    weight = torch.randn(5, dtype=torch.float64, requires_grad=True)

    full = aggregate_loss(x * weight, mask, mode)
    (full_grad,) = torch.autograd.grad(full, weight)

    tokens = mask.sum().item()
    seqs = (mask.sum(-1) > 0).sum().item()
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        total = total + aggregate_loss(
            x[rows] * weight, mask[rows], mode, global_token_count=tokens, global_seq_count=seqs
        )
    (acc_grad,) = torch.autograd.grad(total, weight)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(acc_grad, full_grad)


def test_unknown_mode():
    with pytest.raises(ValueError, match="allowed"):
        aggregate_loss(VALUES, MASK, "seq-mean")


def test_masked_whiten_statistics_and_small_cases():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    w = masked_whiten(x, m)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    expected = (valid - 2.5) / torch.sqrt(valid.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(w[m > 0], expected)
    assert w[0, 2] == 0 and w[1, 2] == 0
    one = torch.tensor([[0, 1, 0], [0, 0, 0]], dtype=torch.float64)
    assert torch.equal(masked_whiten(x, one), torch.zeros_like(x))
    assert torch.equal(masked_whiten(x, torch.zeros_like(x)), torch.zeros_like(x))
    assert masked_mean(x, torch.zeros_like(x)).item() == 0.0


def test_masked_var_hand_computed_and_degenerate_selections():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    assert masked_var(values, mask).item() == pytest.approx(1.0)  # (1 + 0 + 1) / (3 - 1)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    # verl raises for these; 0 keeps a tiny micro-batch from crashing a run
    assert masked_var(values, torch.tensor([0.0, 0, 0, 0])).item() == 0.0
    assert masked_var(values, torch.tensor([0.0, 1, 0, 0])).item() == 0.0


def test_masked_whiten_without_shifting_the_mean():
    values = torch.tensor([1.0, 3.0, 5.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    # mean 3, unbiased var 4: whiten = (x - 3) / 2, then + 3 back (verl's shift_mean=False)
    expected = torch.tensor([2.0, 3.0, 4.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False), expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(masked_whiten(values, mask), expected - 3 * mask, atol=1e-7, rtol=0)
    one = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert masked_whiten(values, one, shift_mean=False).tolist() == [0.0, 3.0, 0.0, 0.0]
