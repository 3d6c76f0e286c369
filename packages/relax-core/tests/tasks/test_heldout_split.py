"""The quick-start task's held-out split: never in the training rows, each sum's mirror always in them."""

from __future__ import annotations

import pytest

from relax.core.tasks.arithmetic import arithmetic_rows, heldout_problems, heldout_rows


def test_heldout_sums_are_out_of_training_and_their_mirrors_in():
    held = heldout_rows(10, seed=3)
    train = {r["prompt"] for r in arithmetic_rows(3000, seed=3, heldout=10)}
    assert len(held) == len({r["prompt"] for r in held}) == 10
    assert not train & {r["prompt"] for r in held}
    for a, op, b, answer in heldout_problems(10, seed=3):
        assert a < b and f"{b}{op}{a}=" in train and answer == a + b
    assert len(train) == 55 - 10  # every other sum is still trained on
    assert heldout_rows(10, seed=3) == held and heldout_rows(10, seed=4) != held  # a function of the seed


def test_limits():
    assert heldout_rows(0) == []
    with pytest.raises(ValueError, match="only 25 problems can be held out"):
        heldout_problems(26)
