"""``dapo``: the DAPO recipe's math reward -- +1 / -1 on the last "Answer: ..." line within a bounded
tail of the response, compared after Minerva normalisation (Hendrycks MATH / lm-eval rules)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from relax.rewards.answers import last_boxed

# Minerva answer normalisation (the lists used by DAPO's math reward)
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)


@dataclass(frozen=True)
class DapoParams:
    """``reward.params`` of ``dapo``."""

    tail_chars: int = 300  # only the response's last characters are read (DAPO: 300)
    answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"
    correct_score: float = 1.0
    wrong_score: float = -1.0

    def validate(self) -> list[str]:
        errors = [] if self.tail_chars >= 1 else [f"tail_chars: must be >= 1, got {self.tail_chars}"]
        try:
            if re.compile(self.answer_pattern).groups < 1:
                errors.append(f"answer_pattern: needs one capture group, got {self.answer_pattern!r}")
        except re.error as e:
            errors.append(f"answer_pattern: not a valid regex ({e})")
        return errors


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation: last side of "=", units/words dropped, TeX shorthand expanded."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for cmd in ("text", "textbf", "overline"):
        answer = re.sub(rf"(\\{cmd}\{{)(.*?)(\}})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_score(response: str, label: Any, metadata: dict[str, Any], params: DapoParams) -> dict[str, float]:
    """``score`` +1/-1, ``acc`` 1/0, ``format`` 1 when an "Answer:" line was found in the tail."""
    if label is None:
        raise ValueError("dapo needs a label (the reference answer); set data.label_key")
    gold = str(label)
    if "\\boxed" in gold:
        gold = last_boxed(gold) or gold
    found = re.findall(params.answer_pattern, response[-params.tail_chars :])
    pred = normalize_final_answer(found[-1]) if found else None
    ok = pred is not None and pred == normalize_final_answer(gold)
    return {
        "score": params.correct_score if ok else params.wrong_score,
        "acc": float(ok),
        "format": float(bool(found)),
    }
