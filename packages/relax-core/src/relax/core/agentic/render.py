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
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("environment: the tokenizer has no chat template to render observations with")
        base = self._template(_PROBE, generation_prompt=False)
        self._base = base
        #: what the template writes after an assistant message's content (end-of-turn token, newline)
        self.turn_close = base[base.rindex("\x00") + 1 :]

    def _template(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

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


def cut_observations(messages: list[dict[str, Any]], tokenizer: Any, max_tokens: int) -> tuple[list[dict[str, Any]], bool]:
    """Messages whose text contents fit ``max_tokens`` tokens in all (each text cut from its end,
    marked ``[truncated]``); media parts are kept. Returns (messages, whether anything was cut)."""
    budget, out, cut = max_tokens, [], False
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str):
            ids = tokenizer(content, add_special_tokens=False)["input_ids"]
            if len(ids) > budget:
                content, cut = tokenizer.decode(ids[: max(0, budget)]) + "[truncated]", True
            budget -= min(len(ids), budget)
        out.append({**message, "content": content})
    return out, cut
