"""pass@k / mean@k / maj@k against hand-computed values."""

from __future__ import annotations

from math import comb

import pytest

from relax.core.evaluation.passk import extract_answer, ks_for, maj_at_k, mean_at_k, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (4, 3, 2, 1.0),  # n - c < k: every pair holds a correct one
    ],
)
def test_pass_at_k_matches_the_hand_computed_value(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_probability_over_every_k_subset():
    """The estimator equals brute force over all C(n, k) subsets (the definition it estimates)."""
    from itertools import combinations

    n, correct = 7, {1, 4}
    for k in range(1, n + 1):
        hits = sum(any(i in correct for i in subset) for subset in combinations(range(n), k))
        assert pass_at_k(n, len(correct), k) == pytest.approx(hits / comb(n, k))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(2, 3, 1)


def test_ks_mean_and_majority():
    assert ks_for(1) == [1] and ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6]
    assert mean_at_k([1.0, 0.0, 0.5, 0.5]) == 0.5
    assert maj_at_k(["7", "3", "7"], [1.0, 0.0, 1.0]) == 1.0
    assert maj_at_k(["3", "7", "3"], [0.0, 1.0, 0.0]) == 0.0
    assert maj_at_k(["3", "7"], [0.0, 1.0]) == 0.0  # a tie goes to the answer seen first
    assert maj_at_k(["3", None], [0.0, 1.0]) is None  # an answer that does not compare: undefined


def test_extract_answer():
    assert extract_answer("so \\boxed{\\frac{1}{2}} is it") == "\\frac{1}{2}"
    assert extract_answer("first 3, then 1,234") == "1234"
    assert extract_answer("  Paris \n") == "Paris"
    assert extract_answer("   ") is None
