"""``multiple_choice`` (alias ``gpqa``): which option letter the response chose, against the label.

Valid letters come from the row's options (``metadata[options_key]``: a list of option texts or a
``{letter: text}`` mapping), else ``params.letters``. The label may be a letter (``"C"``), an index
(``2``) or the option's text. The chosen letter is, in order of preference: a boxed letter
(``\\boxed{C}``, ``\\boxed{\\text{(C)}}``), "Answer: C" / "the answer is (C)", the last standalone
valid letter after ``</think>``.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any

from relax.rewards.answers import after_think, answer_phrase, last_boxed
from relax.rewards.squad import normalize_answer


@dataclass(frozen=True)
class ChoiceParams:
    """``reward.params`` of ``multiple_choice`` / ``gpqa``."""

    options_key: str = "options"  # metadata key with the row's options
    letters: str = "ABCD"  # valid letters when the row has no options
    index_base: int = 0  # an integer label is an index into the options counted from this
    standalone_fallback: bool = True  # accept the last bare valid letter when no explicit form is found

    def validate(self) -> list[str]:
        errors = []
        if not self.letters or not all(c in string.ascii_uppercase for c in self.letters):
            errors.append(f"letters: must be upper-case ASCII letters, got {self.letters!r}")
        if self.index_base not in (0, 1):
            errors.append(f"index_base: must be 0 or 1, got {self.index_base}")
        return errors


def _options(metadata: dict[str, Any], params: ChoiceParams) -> tuple[str, dict[str, str]]:
    """(valid letters, letter -> option text)."""
    options = metadata.get(params.options_key)
    if isinstance(options, dict):
        texts = {str(k).strip().upper(): str(v) for k, v in options.items()}
        return "".join(texts), texts
    if isinstance(options, list | tuple) and options:
        if len(options) > 26:
            raise ValueError(f"multiple_choice: {len(options)} options; at most 26 letters")
        letters = string.ascii_uppercase[: len(options)]
        return letters, dict(zip(letters, map(str, options), strict=True))
    return params.letters, {}


def gold_letter(label: Any, letters: str, texts: dict[str, str], params: ChoiceParams) -> str:
    """The label as a letter: a letter, an index, or the text of one option."""
    if isinstance(label, bool) or label is None:
        raise ValueError(f"multiple_choice: invalid label {label!r}")
    if isinstance(label, int) or (isinstance(label, str) and label.strip().isdigit()):
        i = int(label) - params.index_base
        if not 0 <= i < len(letters):
            raise ValueError(f"multiple_choice: label index {label!r} is outside the {len(letters)} options")
        return letters[i]
    text = str(label).strip()
    bare = text.strip("()[]. ").upper()
    if len(bare) == 1 and bare in letters:
        return bare
    for letter, option in texts.items():
        if normalize_answer(option) == normalize_answer(text):
            return letter
    raise ValueError(
        f"multiple_choice: label {label!r} is neither a valid letter ({letters}), an index nor an option text"
    )


def _letter_in(fragment: str, letters: str) -> str | None:
    """A single valid letter standing for the whole fragment: "C", "(C)", "\\text{C}", "**C.**", "C) foo"."""
    frag = (
        re.sub(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}", r"\1", fragment).strip().strip("*$ ").strip()
    )
    m = re.match(r"^[(\[]?([A-Za-z])[)\].:]?(?:\s|$)", frag)
    if m and m.group(1).upper() in letters and (m.group(1).isupper() or len(frag) <= 3):
        return m.group(1).upper()
    return None


def chosen_letter(response: str, letters: str, standalone_fallback: bool = True) -> tuple[str | None, str]:
    """``(letter, how)`` with ``how`` one of ``"boxed"``, ``"phrase"``, ``"standalone"``, ``"none"``."""
    text = after_think(response)
    if text is None:
        return None, "none"
    boxed = last_boxed(text)
    if boxed is not None and (letter := _letter_in(boxed, letters)):
        return letter, "boxed"
    phrase = answer_phrase(text)
    if phrase is not None and (letter := _letter_in(phrase, letters)):
        return letter, "phrase"
    if standalone_fallback:
        found = re.findall(rf"(?<![A-Za-z0-9'’])\(?([{letters}])\)?(?![A-Za-z0-9'’])", text)
        if found:
            return found[-1], "standalone"
    return None, "none"


def choice_score(
    response: str, label: Any, metadata: dict[str, Any], params: ChoiceParams
) -> dict[str, float]:
    """``score``/``acc`` 1 for the right letter; ``format`` 1 for a boxed or "Answer:" letter;
    ``parsed`` 1 when any valid letter was found."""
    letters, texts = _options(metadata, params)
    gold = gold_letter(label, letters, texts, params)
    letter, how = chosen_letter(response, letters, params.standalone_fallback)
    acc = float(letter == gold)
    return {
        "score": acc,
        "acc": acc,
        "format": float(how in ("boxed", "phrase")),
        "parsed": float(letter is not None),
    }
