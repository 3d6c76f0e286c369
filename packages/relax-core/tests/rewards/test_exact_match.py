import asyncio

import pytest

from relax.core.data import Sample
from relax.core.rewards import ExactMatchReward, NumericReward
from relax.core.rewards.numeric import extract_number


def score(reward, response, label):
    return asyncio.run(reward.score(Sample(prompt_ids=[1], group_id=0, response_text=response, label=label)))


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("7", "7", 1.0),
        ("  7\n", "7", 1.0),
        ("7", 7, 1.0),
        ("Paris", "paris", 1.0),
        ("New  York", "new york", 1.0),
        ("7a", "7", 0.0),
        ("8", "7", 0.0),
        ("", "7", 0.0),
        ("b", ["a", "B"], 1.0),
    ],
)
def test_exact_match(response, label, expected):
    assert score(ExactMatchReward(), response, label) == expected


def test_exact_match_case_sensitive_and_missing_label():
    assert score(ExactMatchReward(case_sensitive=True), "Paris", "paris") == 0.0
    with pytest.raises(ValueError, match="needs a label"):
        score(ExactMatchReward(), "x", None)


@pytest.mark.parametrize(
    "text, mode, value",
    [
        ("7", "first", 7.0),
        ("it is -3.5 or 2", "first", -3.5),
        ("it is -3.5 or 2", "last", 2.0),
        ("total 1,234 apples", "first", 1234.0),
        ("no digits", "first", None),
        (".5 cup", "first", 0.5),
        ("first 3, so \\boxed{42} hmm 9", "answer", 42.0),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "answer", 0.5),
        ("\\boxed{-\\dfrac{3}{4}}", "answer", -0.75),
        ("so the answer is 3/4.", "answer", 0.75),
        ("steps 3 4, the answer is 12. check 5", "answer", 12.0),
        ("no marker 3 then 8", "answer", 8.0),
    ],
)
def test_extract_number(text, mode, value):
    assert extract_number(text, mode) == value


def test_numeric_reward():
    r = NumericReward()
    assert score(r, "7", "7") == {"score": 1.0, "parsed_ok": 1.0}
    assert score(r, "7.0000001 apples", 7) == {"score": 1.0, "parsed_ok": 1.0}
    assert score(r, "8", "7") == {"score": 0.0, "parsed_ok": 1.0}
    assert score(r, "seven", "7") == {"score": 0.0, "parsed_ok": 0.0}
    assert score(NumericReward(mode="answer"), "3 + 4 gives \\boxed{7}", "7.0")["score"] == 1.0
    assert score(NumericReward(rel_tol=0.01), "101", "100")["score"] == 1.0
    assert score(NumericReward(mode="answer"), "\\boxed{0.5}", "1/2")["score"] == 1.0
    with pytest.raises(ValueError, match="numeric label"):
        score(r, "7", "seven")
    with pytest.raises(ValueError, match="mode"):
        NumericReward(mode="middle")
