"""``openr1_mm``: the multimodal Open-R1 reward -- accuracy on the ``<answer>`` content plus format.

Accuracy, as in open-r1-multimodal: math-verify equivalence of the ``<answer>`` content with the
label (itself optionally wrapped in ``<answer>``), else the option letter for a choice label, else
normalised exact match. Format: ``<think>...</think>`` then ``<answer>...</answer>`` and nothing
else, each tag exactly once. ``score = acc_weight * acc + format_weight * format``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from relax.rewards.choice import chosen_letter
from relax.rewards.mathverify import parse_gold
from relax.rewards.squad import normalize_answer

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


@dataclass(frozen=True)
class OpenR1Params:
    """``reward.params`` of ``openr1_mm``."""

    acc_weight: float = 1.0
    format_weight: float = 1.0
    verify_timeout_s: int = 5  # math-verify's own SIGALRM limit per parse/verify


def format_ok(response: str) -> bool:
    """``<think>…</think><answer>…</answer>`` (whitespace around allowed), no tag duplicated."""
    return bool(_FORMAT.fullmatch(response)) and all(response.count(tag) == 1 for tag in _TAGS)


def _content(text: str) -> str:
    m = _ANSWER.search(text)
    return (m.group(1) if m else text).strip()


def accuracy(response: str, label: Any, timeout_s: int = 5) -> float:
    from math_verify import parse, verify

    gold_text = _content(str(label))
    m = _ANSWER.search(response)
    if m is None:
        return 0.0
    answer = m.group(1).strip()
    gold = parse_gold(gold_text, timeout_s)
    if gold:
        pred = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
        if pred and verify(gold, pred, timeout_seconds=timeout_s):
            return 1.0
    bare = gold_text.strip("()[]. ")
    if len(bare) == 1 and bare.isalpha():
        letter, _ = chosen_letter(answer, bare.upper() + "ABCDEFGHIJ".replace(bare.upper(), ""))
        return float(letter == bare.upper())
    return float(normalize_answer(answer) == normalize_answer(gold_text))


def openr1_score(
    response: str, label: Any, metadata: dict[str, Any], params: OpenR1Params
) -> dict[str, float]:
    if label is None:
        raise ValueError("openr1_mm needs a label (the reference answer); set data.label_key")
    acc = accuracy(response, label, params.verify_timeout_s)
    fmt = float(format_ok(response))
    return {"score": params.acc_weight * acc + params.format_weight * fmt, "acc": acc, "format": fmt}
