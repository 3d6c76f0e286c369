"""The built-in calculator: arithmetic through ``ast``, never ``eval``, bounded."""

from __future__ import annotations

import time

import pytest

from relax.agents.calculator import CalculatorError, calculator, evaluate


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*456", "56088"),
        ("(2+3)**2", "25"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("-4 + +2", "-2"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("1.5e3 * 2", "3000"),
        (" 2 ** -1 ", "0.5"),
    ],
)
def test_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("'a' * 3", "unsupported element Constant"),
        ("1/0", "division by zero"),
        ("2 ** 100000", "exponent"),
        ("9 ** 999", "more than 100 digits"),
        ("10**99 * 10**99", "more than 100 digits"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than"),
    ],
)
def test_refuses_what_is_not_bounded_arithmetic(expression, why):
    started = time.monotonic()
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)
    assert (
        time.monotonic() - started < 10
    )  # refused up front: evaluating any of these would take minutes or more
