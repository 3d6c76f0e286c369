"""``dapo``: +1/-1 on the last "Answer:" line in the tail, Minerva normalisation."""

from __future__ import annotations

import pytest

from relax.rewards.dapo import DapoParams, dapo_score, normalize_final_answer

P = DapoParams()

CASES = [
    ("Answer: 42", "42", 1.0),
    ("Answer: 41", "42", -1.0),
    ("answer : 42", "42", 1.0),  # case and spaces
    ("Answer: $42$", "42", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # TeX shorthand
    ("Answer: 5 cm", "5", 1.0),  # unit removed
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer: x = 3", "3", 1.0),  # right side of "="
    ("Answer: \\text{(B)}", "(B)", 1.0),
    ("Answer: 3\nAnswer: 4", "4", 1.0),  # the last one counts
    ("Answer: 4\nAnswer: 3", "4", -1.0),
    ("The answer is 42", "42", -1.0),  # DAPO wants "Answer:"
    ("", "42", -1.0),
    ("\\boxed{42}", "42", -1.0),  # no Answer line
    ("Answer: 42", "\\boxed{42}", 1.0),  # a boxed label is unboxed
    ("Answer: 42" + " filler" * 100, "42", -1.0),  # outside the 300-char tail
    ("x" * 100_000 + "\nAnswer: 7", "7", 1.0),  # 100 kB output, answer at the end
    ("答案 Answer: 七", "七", 1.0),  # unicode
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # string comparison, no symbolic equivalence
]


@pytest.mark.parametrize(("response", "label", "score"), CASES)
def test_dapo_cases(response, label, score):
    out = dapo_score(response, label, {}, P)
    assert out["score"] == score and out["acc"] == float(score > 0), out


def test_normalisation_and_params():
    assert normalize_final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert normalize_final_answer("10 dollars") == "10"
    assert dapo_score("Answer: 1", "2", {}, DapoParams(wrong_score=0.0))["score"] == 0.0
    assert DapoParams(answer_pattern="(").validate() and DapoParams(answer_pattern="x").validate()
    with pytest.raises(ValueError, match="needs a label"):
        dapo_score("Answer: 1", None, {}, P)
