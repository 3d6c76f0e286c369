"""``f1`` and ``exact_match_squad``: SQuAD v1.1 answer normalisation, token-multiset F1 and exact
match, the maximum over every gold answer."""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from relax.rewards.answers import after_think, final_answer

_PUNCT = set(string.punctuation)


@dataclass(frozen=True)
class SquadParams:
    """``reward.params`` of ``f1`` / ``exact_match_squad``."""

    # which part of the response is the answer: "answer" = \boxed{} / "Answer:" if present, else
    # everything after </think>; "full" = the whole response
    extract: Literal["answer", "full"] = "answer"
    answers_key: str | None = None  # metadata key holding more gold answers (a list), e.g. "answers"


def normalize_answer(text: str) -> str:
    """SQuAD v1.1: lower case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _golds(label: Any, metadata: dict[str, Any], params: SquadParams) -> list[str]:
    golds = list(label) if isinstance(label, list | tuple) else [] if label is None else [label]
    if params.answers_key:
        extra = metadata.get(params.answers_key)
        golds += list(extra) if isinstance(extra, list | tuple) else [] if extra is None else [extra]
    if not golds:
        raise ValueError("f1/exact_match_squad need a label or metadata answers; set data.label_key")
    return [str(g) for g in golds]


def prediction_of(response: str, extract: str) -> str:
    if extract == "full":
        return response
    text = after_think(response) or ""
    answer, _ = final_answer(text)
    return answer if answer is not None else text


def f1_score(response: str, label: Any, metadata: dict[str, Any], params: SquadParams) -> dict[str, float]:
    pred = prediction_of(response, params.extract)
    golds = _golds(label, metadata, params)
    best_f1 = max(f1(pred, g) for g in golds)
    return {"score": best_f1, "f1": best_f1, "em": max(exact_match(pred, g) for g in golds)}


def em_score(response: str, label: Any, metadata: dict[str, Any], params: SquadParams) -> dict[str, float]:
    out = f1_score(response, label, metadata, params)
    return {"score": out["em"], "acc": out["em"], "f1": out["f1"]}
