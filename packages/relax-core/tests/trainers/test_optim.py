import math

import pytest

from relax.core.policy_update import lr_factor


def test_warmup_is_linear_and_starts_above_zero():
    assert [lr_factor(s, 4, 0, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_to_min_ratio():
    # warmup 2, decay over steps 2..6 to 0.1
    got = [lr_factor(s, 2, 6, "linear", 0.1) for s in range(8)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_cosine_decay():
    assert lr_factor(0, 0, 10, "cosine") == 1.0
    assert lr_factor(5, 0, 10, "cosine", 0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_factor(3, 0, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))
    assert lr_factor(12, 0, 10, "cosine", 0.2) == pytest.approx(0.2)


def test_no_total_steps_means_no_decay_and_unknown_schedule_raises():
    assert lr_factor(100, 0, 0, "cosine") == 1.0
    with pytest.raises(ValueError, match="allowed: constant, linear, cosine"):
        lr_factor(0, 0, 0, "step")
