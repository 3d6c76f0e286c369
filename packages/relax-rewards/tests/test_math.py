"""``math``: answer extraction and math-verify equivalence on outputs shaped like real ones."""

from __future__ import annotations

import pytest

from relax.rewards.answers import answer_phrase, final_answer, last_boxed
from relax.rewards.mathverify import MathParams, math_score

P = MathParams()
LONG = "Let me think step by step. " * 4000  # ~100 kB of reasoning

# (response, label, expected acc)
CASES = [
    ("The sum is \\boxed{7}.", "7", 1.0),
    ("The sum is \\boxed{8}.", "7", 0.0),
    ("So x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal
    ("\\boxed{0.5}", "\\frac12", 1.0),  # decimal vs shorthand \frac12
    ("\\boxed{1,2}", "\\{1,2\\}", 1.0),  # a bare list is a set
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),  # sets are unordered
    ("\\boxed{50\\%}", "0.5", 1.0),  # percentages
    ("\\boxed{0.5}", "50\\%", 1.0),
    ("\\boxed{[1, 2)}", "[1,2)", 1.0),  # intervals
    ("\\boxed{(1, 2)}", "(1,2]", 0.0),  # open vs half-open
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # units
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # symbolic
    ("\\boxed{1,000}", "1000", 1.0),  # thousands separator
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("Answer: 42", "42", 1.0),  # "Answer:" form
    ("The final answer is $\\frac{3}{5}$.", "0.6", 1.0),  # "The answer is" form
    ("The answer is 41.", "42", 0.0),
    ("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4", 1.0),  # after </think>
    ("<think>maybe \\boxed{4}</think> so \\boxed{3}", "4", 0.0),
    ("<think>I will answer \\boxed{4} but the budget ran out", "4", 0.0),  # unclosed think
    ("first \\boxed{2} then \\fbox{5}", "5", 1.0),  # the last box wins, \fbox too
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces
    ("", "7", 0.0),  # empty
    ("I don't know.", "7", 0.0),  # missing answer
    ("答案是 \\boxed{12} 。", "12", 1.0),  # unicode around
    ("\\boxed{", "7", 0.0),  # malformed box
    (LONG + "\\boxed{13}", "13", 1.0),  # 100 kB output
    ("\\boxed{x = 3}", "3", 1.0),  # math-verify compares an equation's right side
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("so it is 9", "\\boxed{9}", 1.0),  # no explicit answer: math-verify searches the tail
]


@pytest.mark.parametrize(("response", "label", "acc"), CASES)
def test_math_cases(response, label, acc):
    out = math_score(response, label, {}, P)
    assert out["acc"] == acc and out["score"] == acc, out


def test_components_and_require_format():
    out = math_score("it is 9", "9", {}, P)
    assert out == {"score": 1.0, "acc": 1.0, "format": 0.0, "parsed": 1.0}
    strict = math_score("it is 9", "9", {}, MathParams(require_format=True))
    assert strict["score"] == 0.0 and strict["parsed"] == 0.0
    assert math_score("\\boxed{9}", "9", {}, P)["format"] == 1.0


def test_several_gold_answers_and_bad_labels():
    assert math_score("\\boxed{3}", ["2", "3"], {}, P)["acc"] == 1.0
    with pytest.raises(ValueError, match="needs a label"):
        math_score("\\boxed{3}", None, {}, P)
    with pytest.raises(ValueError, match="cannot parse the label"):
        math_score("\\boxed{3}", "", {}, P)


def test_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed 5") == "5"
    assert last_boxed("no box") is None
    assert answer_phrase("**Answer:** 12.") == "12"
    assert answer_phrase("The answer is $x+1$.") == "x+1"
    assert final_answer("Answer: \\boxed{4}") == ("4", "boxed")
    assert final_answer("nothing") == (None, "none")


def test_last_answer_phrase_on_a_line_wins():
    # a response that revises itself on one line means its last answer (issue 31)
    assert answer_phrase("Answer: A, but rechecking the units ... Answer: C") == "C"
    assert answer_phrase("Answer: 3 ... Answer: 5") == "5"
    assert answer_phrase("Answer: 3, so the answer is 5.") == "5"
    assert answer_phrase("Answer: 3\nchecked twice") == "3"
    assert answer_phrase("Answer: 4\nAnswer: 7\nanswer: **") == "7"  # an empty last phrase is skipped
    assert final_answer("Answer: 3 ... Answer: 5") == ("5", "phrase")
    assert math_score("Answer: 3 ... Answer: 5", "5", {}, P)["acc"] == 1.0
    assert math_score("Answer: 3 ... Answer: 5", "3", {}, P)["acc"] == 0.0
