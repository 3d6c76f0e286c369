"""``exact_match`` reward: 1.0 when the normalised response equals the normalised label."""

from __future__ import annotations

from typing import Any


def normalize(text: str, case_sensitive: bool = False) -> str:
    """Strip, collapse runs of whitespace to one space, and (by default) case-fold."""
    text = " ".join(str(text).split())
    return text if case_sensitive else text.casefold()


class ExactMatchReward:
    """Score 1.0 if the response matches the label (or any label, when the label is a list)."""

    def __init__(self, case_sensitive: bool = False) -> None:
        self.case_sensitive = case_sensitive

    async def score(self, sample: Any) -> float:
        if sample.label is None:
            raise ValueError("exact_match needs a label; set data.label_key")
        labels = sample.label if isinstance(sample.label, list | tuple) else [sample.label]
        response = normalize(sample.response_text, self.case_sensitive)
        return float(any(response == normalize(str(lab), self.case_sensitive) for lab in labels))
