"""Where a model put its final answer: after ``</think>``, in the last ``\\boxed{}``, after "Answer:".

Pure string functions shared by the rewards; none of them imports a heavy library.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_PHRASE = re.compile(
    r"(?:\banswer\s*(?:is)?\s*[:：]|\bthe\s+(?:final\s+)?answer\s+is\b\s*:?)[ \t]*", re.IGNORECASE
)


def after_think(text: str) -> str | None:
    """The part after the last ``</think>``; the whole text if there is no think block; None when a
    ``<think>`` was opened and never closed (the model ran out of tokens mid-reasoning)."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def _balanced(text: str, open_at: int) -> str | None:
    """Content of the brace group opening at ``text[open_at] == "{"`` (nested braces balanced)."""
    depth = 0
    for j in range(open_at, len(text)):
        c = text[j]
        if c == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif c == "}" and (j == 0 or text[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : j]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None."""
    best: tuple[int, str] | None = None
    for cmd in _BOX_COMMANDS:
        start = text.rfind(cmd)
        while start >= 0:
            rest = start + len(cmd)
            if rest < len(text) and text[rest] == "{":
                content = _balanced(text, rest)
            elif text[rest : rest + 1] == " ":
                content = text[rest + 1 :].split("$")[0].split()[0] if text[rest + 1 :].strip() else None
            else:
                content = None
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(cmd, 0, start)
    return None if best is None else best[1]


def answer_phrase(text: str) -> str | None:
    """What follows the last "Answer:" / "The (final) answer is", up to the end of its line or the next
    such phrase on it (a response that revises itself on one line, "Answer: A ... Answer: C", means its
    last answer), without markdown or a closing period; None if there is no such phrase or nothing
    follows it."""
    matches = list(_ANSWER_PHRASE.finditer(text))
    for i in reversed(range(len(matches))):
        start = matches[i].end()
        line_end = text.find("\n", start)
        end = len(text) if line_end < 0 else line_end
        if i + 1 < len(matches):
            end = min(end, matches[i + 1].start())
        value = text[start:end].strip().strip("*").strip()
        value = value[:-1].rstrip() if value.endswith(".") else value
        value = re.sub(r"^\$+|\$+$", "", value).strip()
        if value:
            return value
    return None


def final_answer(text: str) -> tuple[str | None, str]:
    """``(answer, how)``: ``how`` is ``"boxed"``, ``"phrase"`` or ``"none"`` (answer None)."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip(), "boxed"
    phrase = answer_phrase(text)
    if phrase is not None:
        inner = last_boxed(phrase)
        return (inner.strip() if inner else phrase), "phrase"
    return None, "none"
