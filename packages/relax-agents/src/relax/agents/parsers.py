"""Tool-call parsers: find the calls a policy turn makes in its text (``environment.tool_parser``).

A parser is any registered factory ``factory(params, ctx) -> ToolParser`` whose ``parse(text)``
returns ``(text without the call markup, calls in order)``; a malformed call becomes a ``ToolCall``
with ``error`` set, never an exception, so the episode can tell the policy what it got wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax.agents.config import HermesParams
from relax.core.protocols import ToolCall


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    ``arguments`` may also be a JSON string holding an object (some models write it that way). A
    start tag without its end tag (a turn cut by length) is a malformed call."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end
        self._block = re.compile(
            re.escape(start) + r"(.*?)(?:(?P<end>" + re.escape(end) + r")|\Z)", re.DOTALL
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        for i, match in enumerate(self._block.finditer(text)):
            raw = match.group(0)
            if match.group("end") is None:
                calls.append(
                    ToolCall("", id=f"call_{i}", error=f"{self.start} without a closing {self.end}", raw=raw)
                )
                continue
            calls.append(_call_from_json(match.group(1).strip(), raw, f"call_{i}"))
        content = self._block.sub("", text).strip()
        return content, calls


def _call_from_json(body: str, raw: str, call_id: str) -> ToolCall:
    try:
        data: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(
            "", id=call_id, error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})", raw=raw
        )
    if not isinstance(data, dict):
        return ToolCall(
            "", id=call_id, error=f"the tool call must be a JSON object, got {type(data).__name__}", raw=raw
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", id=call_id, error='the tool call has no "name" string', raw=raw)
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # '{"a": 1}' written as a string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(
                name, id=call_id, error='"arguments" is a string that is not a JSON object', raw=raw
            )
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(
            name,
            id=call_id,
            error=f'"arguments" must be a JSON object, got {type(arguments).__name__}',
            raw=raw,
        )
    return ToolCall(name, arguments, id=call_id, raw=raw)


def hermes_parser(params: HermesParams, ctx: Any) -> HermesParser:
    return HermesParser(params.start, params.end)
