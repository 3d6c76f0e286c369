"""Tools as the ``tools`` environment sees them: a name, a JSON schema and a call.

Any Python callable becomes a tool: its name, docstring (first paragraph, plus Google-style
``Args:`` lines) and signature (type hints) give the OpenAI ``function`` schema the model is shown.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class ToolError(Exception):
    """A tool failed in a way the policy should read (the message becomes the error observation)."""


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def __call__(self, arguments: dict[str, Any]) -> Any:
        """The tool's output (str, bytes, or anything JSON-serialisable); raises on failure."""
        ...


@dataclass(frozen=True)
class FunctionTool:
    """A Python callable called with the parsed arguments as keywords."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def __call__(self, arguments: dict[str, Any]) -> Any:
        return self.function(**arguments)


_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
    type(None): "null",
}


def json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint (``{}`` = anything, when the hint says nothing JSON can check)."""
    origin = typing.get_origin(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (typing.Union, types.UnionType):
        options = [json_type(a) for a in typing.get_args(hint)]
        return {} if any(not o for o in options) else {"anyOf": options}
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(hint)
        return {
            "type": "array",
            **({"items": json_type(args[0])} if args and args[0] is not Ellipsis else {}),
        }
    if origin is dict:
        return {"type": "object"}
    return {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(summary paragraph, {argument: description}) of a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)", line)
            if m:
                args[m.group(1)] = m.group(2).strip()
    return summary, args


def tool_from_callable(function: Callable[..., Any], name: str | None = None) -> FunctionTool:
    """A tool whose schema comes from ``function``'s signature and docstring."""
    summary, arg_docs = _docstring_parts(function.__doc__ or "")
    hints = typing.get_type_hints(function)
    properties: dict[str, Any] = {}
    required: list[str] = []
    open_ended = False  # **kwargs: any other argument is accepted
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            open_ended = open_ended or param.kind == param.VAR_KEYWORD
            continue
        schema = json_type(hints.get(param.name, Any))
        if param.name in arg_docs:
            schema = {**schema, "description": arg_docs[param.name]}
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    if not open_ended:  # an unknown argument is a bad-arguments observation, not a TypeError in the call
        parameters["additionalProperties"] = False
    return FunctionTool(name or function.__name__, summary, parameters, function)


def load_callable(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` (or ``"module:Class.method"``) imported."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tool {path!r}: expected 'module:function'")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"tool {path!r}: {type(target).__name__} is not callable")
    return target


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str:
    """'' when ``arguments`` fit the tool's schema, else what is wrong (for the error observation)."""
    import jsonschema

    try:
        jsonschema.validate(arguments, tool.parameters)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path)
        return f"{where + ': ' if where else ''}{exc.message}"
    except jsonschema.SchemaError as exc:  # the tool's own schema is broken: say so, do not crash
        return f"the tool's schema is invalid ({exc.message})"
    return ""


def openai_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of one tool."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def tools_system_prompt(
    schemas: list[dict[str, Any]], preamble: str = "", start: str = "<tool_call>", end: str = "</tool_call>"
) -> str:
    """A system prompt that shows the model its tools and the Hermes call format (as Qwen's chat
    template writes it), for datasets whose tokenizer template does not render ``tools`` itself."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        (preamble.rstrip() + "\n\n" if preamble else "")
        + "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        + f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
        + f"For each function call, return a json object with function name and arguments within {start}{end} XML tags:\n"
        + f'{start}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{end}'
    )
