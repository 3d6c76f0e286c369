"""Observation messages -> token ids that continue a trajectory, with the model's chat template."""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]


class ObservationRenderer:
    """Renders observations as exactly the text the chat template would put after an assistant turn.

    The template is applied to a probe conversation with and without the observations; the
    difference is the continuation (the observations plus the next assistant header). What the
    template writes after an assistant turn's end-of-turn token (Qwen: ``"\\n"``) is prepended when
    the turn ended on it; a turn cut by length is closed first, as the template would close it.
    """

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: a tokenizer, or an HF processor (its template renders media placeholders)."""
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
        self.templater = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("environment: the tokenizer has no chat template to render observations with")
        base = self._template(_PROBE, generation_prompt=False)
        self._base = base
        #: what the template writes after an assistant message's content (end-of-turn token, newline)
        self.turn_close = base[base.rindex("\x00") + 1 :]

    def _template(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.templater.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def text(self, messages: list[dict[str, Any]], ended_with: str | None) -> str:
        """The continuation text after a turn whose last sampled token decodes to ``ended_with``
        (its end-of-turn token), or after a turn that ended without one (``None``)."""
        full = self._template([*_PROBE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "environment: the chat template renders earlier turns differently once observations follow; "
                "observations cannot be appended as a continuation with this template"
            )
        close = self.turn_close
        if ended_with and close.startswith(ended_with):
            close = close[len(ended_with) :]
        return close + full[len(self._base) :]

    def ids(self, messages: list[dict[str, Any]], ended_with: str | None) -> list[int]:
        return list(self.tokenizer(self.text(messages, ended_with), add_special_tokens=False)["input_ids"])


TRUNCATED = "[truncated]"


def fit_observations(
    renderer: ObservationRenderer, messages: list[dict[str, Any]], ended_with: str | None, max_tokens: int
) -> tuple[list[int], bool]:
    """The observations' continuation ids, their text contents cut from the end (marked ``[truncated]``)
    so that the whole continuation, template tokens included, fits ``max_tokens`` where it can.
    Returns (ids, whether anything was cut)."""
    ids = renderer.ids(messages, ended_with)
    if len(ids) <= max_tokens:
        return ids, False
    tok = renderer.tokenizer
    texts = [m for m in messages if isinstance(m.get("content"), str)]
    empty = [{**m, "content": "" if isinstance(m.get("content"), str) else m["content"]} for m in messages]
    marker = len(tok(TRUNCATED, add_special_tokens=False)["input_ids"])
    budget = max(0, max_tokens - len(renderer.ids(empty, ended_with)) - marker * len(texts))
    cut = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            content_ids = tok(content, add_special_tokens=False)["input_ids"]
            if len(content_ids) > budget:
                content = tok.decode(content_ids[:budget]) + TRUNCATED
            budget -= min(len(content_ids), budget)
        cut.append({**message, "content": content})
    return renderer.ids(cut, ended_with), True
