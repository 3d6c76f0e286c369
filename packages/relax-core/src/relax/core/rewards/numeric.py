"""``numeric`` reward: parse a number from the response and compare it with the label."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

# integers or decimals, optional sign, optional thousands separators ("1,234.5")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRACTION = re.compile(
    r"^\s*(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}\s*$|^\s*([-+]?[\d.]+)\s*/\s*([\d.]+)\s*$"
)
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*\$?\s*([-+]?[\d.,]+(?:\s*/\s*[\d.]+)?)", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _to_float(token: str) -> float | None:
    try:
        return float(token.replace(",", ""))
    except ValueError:
        return None


def _parse_final(text: str) -> float | None:
    """A final answer: ``\\frac{a}{b}`` or ``a/b`` as a fraction, otherwise its first number."""
    m = _FRACTION.match(text)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else ("", m.group(4), m.group(5))
        a, b = _to_float(num), _to_float(den)
        if a is not None and b:
            return -a / b if sign else a / b
    return extract_number(text, "first")


def extract_number(text: str, mode: Literal["first", "last", "answer"] = "first") -> float | None:
    """The number the response answers with, or None.

    ``first``/``last``: the first/last number anywhere. ``answer``: the last ``\\boxed{}`` (a
    fraction there counts as its value), else the number after the last "answer is", else the last
    number anywhere.
    """
    if mode == "answer":
        boxed = _last_boxed(text)
        if boxed is not None:
            return _parse_final(boxed)
        found = _ANSWER_IS.findall(text)
        if found:
            return _parse_final(found[-1])
        mode = "last"
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return _to_float(matches[0] if mode == "first" else matches[-1])


class NumericReward:
    """Returns ``{"score": 1.0/0.0, "parsed_ok": 1.0/0.0}`` (reward info values are all floats)."""

    def __init__(
        self, mode: Literal["first", "last", "answer"] = "first", abs_tol: float = 1e-6, rel_tol: float = 0.0
    ) -> None:
        if mode not in ("first", "last", "answer"):
            raise ValueError(f"numeric reward mode must be 'first', 'last' or 'answer', got {mode!r}")
        self.mode, self.abs_tol, self.rel_tol = mode, abs_tol, rel_tol

    async def score(self, sample: Any) -> dict[str, float]:
        target = _parse_final(str(sample.label)) if sample.label is not None else None
        if target is None:
            raise ValueError(f"numeric reward needs a numeric label, got {sample.label!r}")
        value = extract_number(sample.response_text, self.mode)
        if value is None:
            return {"score": 0.0, "parsed_ok": 0.0}
        ok = math.isclose(value, target, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return {"score": float(ok), "parsed_ok": 1.0}
