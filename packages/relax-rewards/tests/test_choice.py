"""``multiple_choice`` / ``gpqa``: letter extraction and labels as letter, index or option text."""

from __future__ import annotations

import pytest

from relax.rewards.choice import ChoiceParams, choice_score

P = ChoiceParams()
OPTS = {"options": ["Paris", "London", "Berlin", "Madrid"]}

# (response, label, metadata, acc)
CASES = [
    ("\\boxed{C}", "C", {}, 1.0),
    ("\\boxed{\\text{(C)}}", "C", {}, 1.0),
    ("\\boxed{B}", "C", {}, 0.0),
    ("Answer: C", "C", {}, 1.0),
    ("**Answer:** (B)", "B", {}, 1.0),
    ("The answer is (D).", "D", {}, 1.0),
    ("The correct answer is A", "A", {}, 1.0),
    ("<think>A or B? A is wrong.</think> B", "B", {}, 1.0),  # last standalone letter after think
    ("<think>B</think> I pick A.", "B", {}, 0.0),
    ("<think>still thinking about C", "C", {}, 0.0),  # unclosed think
    ("I choose (B) because ...", "B", {}, 1.0),
    ("Answer: E", "A", {}, 0.0),  # E is not an option of a 4-choice row
    ("Answer: E", "E", {"options": list("abcde")}, 1.0),  # ... but is of a 5-choice row
    ("\\boxed{A}", 0, OPTS, 1.0),  # label as an index
    ("\\boxed{B}", 2, {**OPTS}, 0.0),
    ("\\boxed{B}", "London", OPTS, 1.0),  # label as option text
    ("\\boxed{b}", "B", {}, 1.0),  # lower-case boxed letter
    ("", "A", {}, 0.0),  # empty
    ("I am not sure.", "A", {}, 0.0),  # no valid letter ("I" is not one)
    ("答案是 (C)", "C", {}, 1.0),  # unicode
    ("word " * 20_000 + "Answer: D", "D", {}, 1.0),  # 100 kB
    ("\\boxed{C}", "(c)", {}, 1.0),  # label with brackets, lower case
    ("Answer: B", "B", {"options": {"A": "x", "B": "y"}}, 1.0),  # options as a mapping
    # a response that revises itself on one line: the last "Answer:" phrase wins (issue 31)
    ("Answer: A, but rechecking the second option ... Answer: C", "C", {}, 1.0),
    ("Answer: A, but rechecking the second option ... Answer: C", "A", {}, 0.0),
    ("Answer: B. Hmm, the answer is (D).", "D", {}, 1.0),
]


@pytest.mark.parametrize(("response", "label", "metadata", "acc"), CASES)
def test_choice_cases(response, label, metadata, acc):
    out = choice_score(response, label, metadata, P)
    assert out["acc"] == acc, out


def test_components_and_bad_labels():
    assert choice_score("\\boxed{A}", "A", {}, P) == {"score": 1.0, "acc": 1.0, "format": 1.0, "parsed": 1.0}
    assert choice_score("it is A", "A", {}, P)["format"] == 0.0
    assert choice_score("it is A", "A", {}, ChoiceParams(standalone_fallback=False))["parsed"] == 0.0
    assert choice_score("\\boxed{A}", 1, OPTS, ChoiceParams(index_base=1))["acc"] == 1.0
    with pytest.raises(ValueError, match="outside the 4 options"):
        choice_score("A", 7, OPTS, P)
    with pytest.raises(ValueError, match="neither a valid letter"):
        choice_score("A", "Rome", OPTS, P)
    assert ChoiceParams(letters="ab").validate()
