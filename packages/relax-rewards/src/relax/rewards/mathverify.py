"""``math``: the final answer checked for equivalence with the label by math-verify.

math-verify (HuggingFace) compares symbolically: fractions vs decimals, LaTeX vs plain text, sets,
intervals, percentages, units. It is not thread-safe and bounds its own work with ``SIGALRM``, so the
registered ``math`` reward runs it in the hub's process pool (main thread of a worker process, a
wall-clock kill on top); ``math_score`` itself is a plain function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.rewards.answers import after_think, final_answer


@dataclass(frozen=True)
class MathParams:
    """``reward.params`` of ``math`` (and a ``math`` component of the hub)."""

    # no \boxed{} / "Answer:" in the response: score 0 (false: let math-verify search the tail)
    require_format: bool = False
    tail_chars: int = 4000  # without an explicit answer only the last characters are searched
    float_rounding: int = 6  # decimals compared after rounding (math-verify's float_rounding)
    strict: bool = True  # math-verify strict: variables must match, "x=3" is not "3" ... (see its docs)
    verify_timeout_s: int = 5  # math-verify's own SIGALRM limit per parse/verify

    def validate(self) -> list[str]:
        errors = [] if self.tail_chars >= 1 else [f"tail_chars: must be >= 1, got {self.tail_chars}"]
        if self.verify_timeout_s < 1:
            errors.append(f"verify_timeout_s: must be >= 1, got {self.verify_timeout_s}")
        return errors


def warm_math() -> None:
    """Import math-verify (sympy, antlr) and take each of its paths once (boxed, phrase, plain-text tail;
    it compiles large regexes lazily per form): seconds that must not count against a call's limit."""
    for response in ("\\boxed{\\frac{1}{2}}", "The answer is 0.5.", "so it is 1/2"):
        math_score(response, "0.5", {}, MathParams())


def parse_gold(label: Any, timeout_s: int = 5) -> list[Any]:
    """math-verify's parse of a label: ``"\\boxed{..}"``, LaTeX or plain (``"1/2"``, ``"0.5"``, ``7``)."""
    from math_verify import parse

    text = str(label).strip()
    if not text:
        return []
    if "\\boxed" in text or "\\fbox" in text or "$" in text:
        return parse(text, parsing_timeout=timeout_s)
    return parse(f"${text}$", parsing_timeout=timeout_s) or parse(text, parsing_timeout=timeout_s)


def math_score(response: str, label: Any, metadata: dict[str, Any], params: MathParams) -> dict[str, float]:
    """``score``/``acc`` 1.0 when the final answer equals the label; ``format``: an explicit answer
    (boxed or "Answer:") was found; ``parsed``: math-verify understood the prediction."""
    from math_verify import parse, verify

    if label is None:
        raise ValueError("math needs a label (the reference answer); set data.label_key")
    golds = [
        parse_gold(lab, params.verify_timeout_s) for lab in (label if isinstance(label, list) else [label])
    ]
    if not any(golds):
        raise ValueError(f"math: math-verify cannot parse the label {label!r}")
    text = after_think(response)
    if text is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0, "parsed": 0.0}
    answer, how = final_answer(text)
    if answer is not None:
        pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=params.verify_timeout_s)
    elif params.require_format:
        pred = []
    else:
        pred = parse(text[-params.tail_chars :], parsing_timeout=params.verify_timeout_s)
    ok = bool(pred) and any(
        gold
        and verify(
            gold,
            pred,
            float_rounding=params.float_rounding,
            strict=params.strict,
            timeout_seconds=params.verify_timeout_s,
        )
        for gold in golds
    )
    acc = float(ok)
    return {"score": acc, "acc": acc, "format": float(how != "none"), "parsed": float(bool(pred))}
