"""The ``tools`` environment: the policy calls tools until it answers; the answer is scored.

A turn with tool calls gets one ``{"role": "tool", "content": ...}`` observation per call, in
order, and the episode goes on; a turn without any is the final answer, scored against
``sample.label`` (``answer``). Every failure -- malformed call, unknown tool, arguments that do
not fit the schema, a tool that raises, hangs past ``tool_timeout_s`` or returns bytes that are not
UTF-8 -- becomes an error observation that names it, counted as ``tool_errors`` (core ends the
episode instead when ``environment.on_tool_error: end``).
"""

from __future__ import annotations

import json
import math
import pickle
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from relax.agents.config import REPORT_GRACE_S, ToolsEnvParams
from relax.agents.mcp_tools import MCPServers
from relax.agents.tool_worker import ToolCrashed, ToolTimeout, ToolWorkers
from relax.agents.tools import (
    FunctionTool,
    Tool,
    ToolError,
    check_arguments,
    openai_schema,
    tools_system_prompt,
)
from relax.core.agentic.bounded import TIMEOUT, call_all
from relax.core.protocols import StepResult, ToolCall, Turn


def build_tool(entry: str, params: ToolsEnvParams) -> Tool:
    """One entry of ``params.tools``: a built-in, or an imported ``module:function``."""
    from relax.agents.tools import load_callable, tool_from_callable

    if entry == "calculator":
        from relax.agents.calculator import calculator

        return tool_from_callable(calculator)
    if entry == "python":
        from relax.agents.sandbox import python_tool

        return python_tool(replace(params.sandbox, wall_s=min(params.sandbox.wall_s, params.tool_timeout_s)))
    return tool_from_callable(load_callable(entry))


class ToolsEnvironment:
    """Tools resolved once per run and shared by its episodes; MCP servers start on first use."""

    def __init__(self, params: ToolsEnvParams) -> None:
        problems = params.validate()
        if problems:
            raise ValueError("tools environment: " + "; ".join(problems))
        self.params = params
        self._local = [build_tool(entry, params) for entry in params.tools]
        self._mcp = MCPServers(params.mcp_servers, params.tool_timeout_s) if params.mcp_servers else None
        self._tools: dict[str, Tool] | None = None
        self._lock = threading.Lock()
        #: function tools run in killable worker processes (``tool_workers: process``), see relax.agents.tool_worker
        modules = tuple(sorted({t.function.__module__ for t in self._local if isinstance(t, FunctionTool)}))
        self._workers = (
            ToolWorkers(params.tool_timeout_s, preload=modules) if params.tool_workers == "process" else None
        )

    def tools(self) -> dict[str, Tool]:
        """Every tool by name (starting the MCP servers the first time); two tools with one name are an error."""
        with self._lock:
            if self._tools is None:
                found: dict[str, Tool] = {}
                for tool in [*self._local, *(self._mcp.tools() if self._mcp else [])]:
                    if tool.name in found:
                        raise ValueError(
                            f"tools environment: two tools are named {tool.name!r} ({_origin(found[tool.name])} "
                            f"and {_origin(tool)}); set tool_prefix on an MCP server to tell them apart"
                        )
                    found[tool.name] = tool
                self._tools = found
            return self._tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI ``tools`` format (what a chat template's ``tools=`` takes)."""
        return [openai_schema(t) for t in self.tools().values()]

    def system_prompt(self, preamble: str = "") -> str:
        """A system message text that lists the tools and the Hermes call format."""
        return tools_system_prompt(self.tool_schemas(), preamble)

    def start(self, sample: Any) -> ToolsEpisode:
        return ToolsEpisode(self, sample.label)

    def close(self) -> None:
        """Stop the MCP servers (also done at interpreter exit) and the tool worker processes."""
        if self._mcp is not None:
            self._mcp.close()
        if self._workers is not None:
            self._workers.close()

    def _runner(self, tool: Tool, arguments: dict[str, Any]) -> Callable[[], Any]:
        """The call: a plain function tool in a worker process (killed when it overruns); the sandbox and
        MCP tools enforce their own timeouts in their own processes, so they are called as they are."""
        function = getattr(tool, "function", None)
        if self._workers is None or not isinstance(tool, FunctionTool) or not _travels(function):
            return lambda: tool(arguments)
        return lambda: self._workers.call(function, arguments)

    # ------------------------------------------------------------------ one call
    def run_calls(self, calls: list[ToolCall]) -> tuple[list[dict[str, Any]], Counter]:
        """One observation per call, in order, and the counts (``tool_calls_ok``, ``tool_errors``, ...)."""
        observations, counts, _ = self.run_calls_reporting(calls)
        return observations, counts

    def run_calls_reporting(self, calls: list[ToolCall]) -> tuple[list[dict[str, Any]], Counter, list[str]]:
        """:meth:`run_calls` plus the failures that are the tools' own (raised, hung, crashed), one reason
        each, for core's failure report (``StepResult.failures``); the policy's mistakes (a malformed call,
        an unknown tool, bad arguments) are observations only."""
        limit, counts = self.params.max_tool_calls_per_turn, Counter(tool_calls_ok=0, tool_errors=0)
        failures: list[str] = []
        tools = self.tools()
        texts: list[str | None] = [None] * len(calls)
        runnable: list[tuple[int, Tool, dict[str, Any]]] = []
        for i, call in enumerate(calls):
            texts[i] = self._refusal(i, call, tools, limit)
            if texts[i] is None:
                runnable.append((i, tools[call.name], call.arguments))
        if self._workers is not None:  # warm processes first, outside the calls' timeouts
            self._workers.reserve(
                sum(isinstance(t, FunctionTool) and _travels(t.function) for _, t, _ in runnable)
            )
        outcomes = call_all(
            [self._runner(t, a) for _, t, a in runnable], self.params.tool_timeout_s + REPORT_GRACE_S
        )
        for (i, tool, _), (value, error) in zip(runnable, outcomes, strict=True):
            texts[i], kind = _observation_text(tool.name, value, error, self.params.tool_timeout_s)
            counts[kind] += 1
            if kind != "tool_calls_ok":
                counts["tool_errors"] += 1
                failures.append(texts[i].removeprefix("Error: ").split("\n", 1)[0][:300])
        counts["tool_errors"] += len(calls) - len(runnable)
        return [{"role": "tool", "content": text} for text in texts], counts, failures

    def _refusal(self, index: int, call: ToolCall, tools: dict[str, Tool], limit: int) -> str | None:
        """Why a call is not run (its error observation), or None."""
        if call.error:
            return f'Error: malformed tool call: {call.error}. Write {{"name": ..., "arguments": {{...}}}} as JSON.'
        if index >= limit:
            return f"Error: too many tool calls in one turn (at most {limit}); {call.name!r} was not run."
        if call.name not in tools:
            return (
                f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(tools)) or 'none'}."
            )
        problem = check_arguments(tools[call.name], call.arguments)
        return f"Error: bad arguments for tool {call.name!r}: {problem}" if problem else None


class ToolsEpisode:
    def __init__(self, env: ToolsEnvironment, label: Any) -> None:
        self.env, self.label = env, label

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(done=True, reward=self._score(turn.content), info={"answered": 1.0})
        observations, counts, failures = self.env.run_calls_reporting(turn.tool_calls)
        return StepResult(observations, info={k: float(v) for k, v in counts.items()}, failures=failures)

    def _score(self, answer: str) -> float | None:
        params = self.env.params
        if params.answer == "none":
            return None
        if self.label is None:
            raise ValueError(
                f"tools environment answer={params.answer!r} needs a label per row (data.label_key)"
            )
        labels = self.label if isinstance(self.label, list | tuple) else [self.label]
        if params.answer == "exact_match":
            from relax.core.rewards.exact_match import normalize

            return float(
                any(
                    normalize(answer, params.case_sensitive) == normalize(str(lab), params.case_sensitive)
                    for lab in labels
                )
            )
        from relax.core.rewards.numeric import extract_number

        value = extract_number(answer, params.numeric_mode)
        targets = [extract_number(str(lab), "answer") for lab in labels]
        return float(
            value is not None
            and any(
                t is not None and math.isclose(value, t, rel_tol=0.0, abs_tol=params.abs_tol) for t in targets
            )
        )

    def close(self) -> None:
        pass


def _observation_text(
    name: str, value: Any, error: BaseException | None, timeout_s: float
) -> tuple[str, str]:
    """(observation text, counter) for one call's outcome."""
    if value is TIMEOUT or isinstance(error, ToolTimeout):
        return f"Error: tool {name!r} did not finish within {timeout_s:g}s.", "tool_timeouts"
    if isinstance(error, ToolCrashed):
        return f"Error: tool {name!r} crashed: {error}", "tool_failures"
    if isinstance(error, ToolError):
        return f"Error: tool {name!r} failed: {error}", "tool_failures"
    if error is not None:
        return f"Error: tool {name!r} raised {type(error).__name__}: {error}", "tool_failures"
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8"), "tool_calls_ok"
        except UnicodeDecodeError:
            text = bytes(value).decode("utf-8", errors="replace")
            return (
                f"Error: tool {name!r} returned bytes that are not valid UTF-8 "
                f"(decoded with replacement characters): {text}"
            ), "undecodable_outputs"
    if isinstance(value, str):
        return value, "tool_calls_ok"
    try:
        return json.dumps(value, ensure_ascii=False, default=str), "tool_calls_ok"
    except (TypeError, ValueError):
        return str(value), "tool_calls_ok"


def _travels(function: Any) -> bool:
    """Whether ``function`` pickles (by its import path) to a worker process; a lambda or closure runs in a thread."""
    try:
        pickle.dumps(function)
        return True
    except Exception:  # noqa: BLE001
        return False


def _origin(tool: Tool) -> str:
    server = getattr(tool, "server", None)
    if server is not None:
        return f"MCP server {server!r}"
    function = getattr(tool, "function", None)
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', tool.name)}"


def tools_environment(params: ToolsEnvParams, ctx: Any) -> ToolsEnvironment:
    return ToolsEnvironment(params)
