"""``f1`` / ``exact_match_squad``: SQuAD v1.1 normalisation, token F1, max over gold answers."""

from __future__ import annotations

import pytest

from relax.rewards.squad import SquadParams, em_score, f1, f1_score, normalize_answer

P = SquadParams()

# (response, label, f1, em)
CASES = [
    ("Paris", "Paris", 1.0, 1.0),
    ("paris.", "Paris", 1.0, 1.0),  # case and punctuation
    ("The Eiffel Tower", "Eiffel Tower", 1.0, 1.0),  # articles
    ("Eiffel", "Eiffel Tower", 2 / 3, 0.0),  # p=1, r=1/2
    ("the big red dog", "a red dog", 0.8, 0.0),  # p=2/3, r=1
    ("London", "Paris", 0.0, 0.0),
    ("", "Paris", 0.0, 0.0),  # empty
    ("Answer: Paris", "Paris", 1.0, 1.0),  # "Answer:" form
    ("<think>maybe London</think>Paris", "Paris", 1.0, 1.0),
    ("<think>never closed Paris", "Paris", 0.0, 0.0),
    ("\\boxed{Paris}", "Paris", 1.0, 1.0),
    ("Paris", ["London", "paris"], 1.0, 1.0),  # max over gold answers
    ("New York City", ["York", "New York"], 0.8, 0.0),
    ("a an the", "Paris", 0.0, 0.0),  # only articles
    ("München", "münchen", 1.0, 1.0),  # unicode
    ("1,000", "1000", 1.0, 1.0),  # punctuation inside numbers is dropped
    ("dog dog dog", "dog", 0.5, 0.0),  # multiset: p=1/3, r=1
    ("word " * 20_000, "word", 2 / 20_001, 0.0),  # 100 kB
    ("  Paris  ", "Paris", 1.0, 1.0),
    ("Paris, France", "Paris", 2 / 3, 0.0),
    ("Answer: London ... no, Answer: Paris", "Paris", 1.0, 1.0),  # last phrase on the line wins
    ("Answer: 3 ... Answer: 5", "5", 1.0, 1.0),
]


@pytest.mark.parametrize(("response", "label", "f1_value", "em_value"), CASES)
def test_squad_cases(response, label, f1_value, em_value):
    out = f1_score(response, label, {}, P)
    assert out["f1"] == pytest.approx(f1_value) and out["em"] == em_value, out
    assert em_score(response, label, {}, P)["score"] == em_value


def test_normalisation_metadata_answers_and_errors():
    assert normalize_answer("The  Cat, a dog!") == "cat dog"
    assert f1("", "") == 0.0  # SQuAD v1.1: no common tokens is 0
    params = SquadParams(answers_key="answers")
    assert f1_score("Lyon", "Paris", {"answers": ["Lyon"]}, params)["score"] == 1.0
    assert f1_score("Answer: Paris", "Paris", {}, SquadParams(extract="full"))["f1"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="need a label"):
        f1_score("x", None, {}, P)
