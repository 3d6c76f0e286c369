"""The ``tools`` environment driven directly: ``env.start(sample).step(Turn(...))``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relax.agents.config import ToolsEnvParams
from relax.agents.parsers import HermesParser
from relax.agents.tools import tool_from_callable, tools_system_prompt
from relax.agents.tools_env import ToolsEnvironment
from relax.core.data import Sample
from relax.core.plugins import get_plugin_manager
from relax.core.protocols import Turn

FUNCS = [
    "agent_tool_funcs:lookup",
    "agent_tool_funcs:stats",
    "agent_tool_funcs:explode",
    "agent_tool_funcs:hang",
    "agent_tool_funcs:raw_bytes",
]


@pytest.fixture
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _turn(text: str, index: int = 0) -> Turn:
    content, calls = HermesParser().parse(text)
    return Turn(index, text, [], calls, "stop", content)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _sample(label="56088"):
    return Sample(prompt_ids=[1], group_id=0, label=label)


def test_calculator_episode_scores_the_final_numeric_answer():
    env = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="numeric"))
    episode = env.start(_sample())
    first = episode.step(_turn(_call("calculator", expression="123*456")))
    assert not first.done and first.reward is None
    assert first.observations == [{"role": "tool", "content": "56088"}]
    assert first.info == {"tool_calls_ok": 1.0, "tool_errors": 0.0}
    final = episode.step(_turn("The answer is 56088.", 1))
    assert final.done and final.reward == 1.0 and final.observations == []
    assert env.start(_sample()).step(_turn("It is 56000")).reward == 0.0


def test_exact_match_and_none_answers():
    env = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="exact_match"))
    assert env.start(_sample(label=["Paris", "paris, france"])).step(_turn("  PARIS ")).reward == 1.0
    assert env.start(_sample(label="Paris")).step(_turn("Lyon")).reward == 0.0
    with pytest.raises(ValueError, match="needs a label"):
        env.start(_sample(label=None)).step(_turn("x"))
    none = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="none"))
    result = none.start(_sample(label=None)).step(_turn("whatever"))
    assert result.done and result.reward is None


def test_every_failure_is_a_named_error_observation_and_counted(helpers_on_path):
    env = ToolsEnvironment(
        ToolsEnvParams(tools=["calculator", *FUNCS], tool_timeout_s=0.2, max_tool_calls_per_turn=8)
    )
    calls = [
        "<tool_call>{not json}</tool_call>",
        _call("nope"),
        _call("calculator", expr="1+1"),
        _call("calculator", expression="1/0"),
        _call("explode", reason="it was told to"),
        _call("hang", seconds=30),
        _call("raw_bytes", valid=False),
        _call("lookup", key="relax"),
    ]
    started = time.monotonic()
    result = env.start(_sample()).step(_turn(" ".join(calls)))
    assert time.monotonic() - started < 5  # the hang is cut at tool_timeout_s
    texts = [o["content"] for o in result.observations]
    assert all(o["role"] == "tool" for o in result.observations) and len(texts) == len(calls)
    assert texts[0].startswith("Error: malformed tool call: the tool call is not valid JSON")
    assert texts[1].startswith(
        "Error: unknown tool 'nope'; available tools: calculator, explode, hang, lookup"
    )
    assert texts[2].startswith("Error: bad arguments for tool 'calculator'") and "expression" in texts[2]
    assert texts[3] == "Error: tool 'calculator' raised CalculatorError: division by zero"
    assert texts[4] == "Error: tool 'explode' raised ValueError: exploded because it was told to"
    assert texts[5] == "Error: tool 'hang' did not finish within 0.2s."
    assert (
        texts[6].startswith("Error: tool 'raw_bytes' returned bytes that are not valid UTF-8")
        and "caf\ufffd \ufffd" in texts[6]
    )
    assert texts[7] == "an RL engine"
    assert not result.done
    assert result.info == {
        "tool_calls_ok": 1.0,
        "tool_errors": 7.0,
        "tool_failures": 2.0,
        "tool_timeouts": 1.0,
        "undecodable_outputs": 1.0,
    }


def test_callables_results_and_the_call_limit(helpers_on_path):
    env = ToolsEnvironment(ToolsEnvParams(tools=FUNCS, max_tool_calls_per_turn=2))
    result = env.start(_sample()).step(
        _turn(
            _call("stats", values=[1, 2.5], kind="max")
            + _call("raw_bytes", valid=True)
            + _call("lookup", key="x")
        )
    )
    assert [o["content"] for o in result.observations] == [
        '{"kind": "max", "value": 2.5}',
        "héllo",
        "Error: too many tool calls in one turn (at most 2); 'lookup' was not run.",
    ]
    assert result.info["tool_calls_ok"] == 2.0 and result.info["tool_errors"] == 1.0
    bad_enum = env.start(_sample()).step(
        _turn(_call("stats", values=[1], kind="mean") + _call("lookup", key="a", lang="fr"))
    )
    texts = [o["content"] for o in bad_enum.observations]
    assert texts[0] == "Error: bad arguments for tool 'stats': kind: 'mean' is not one of ['sum', 'max']"
    assert texts[1].startswith(
        "Error: bad arguments for tool 'lookup': Additional properties are not allowed ('lang'"
    )


def test_tool_schemas_come_from_signatures_and_docstrings(helpers_on_path):
    env = ToolsEnvironment(
        ToolsEnvParams(tools=["calculator", "agent_tool_funcs:lookup", "agent_tool_funcs:stats"])
    )
    schemas = {s["function"]["name"]: s for s in env.tool_schemas()}
    assert schemas["calculator"] == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return its value.",
            "parameters": {
                "type": "object",
                "required": ["expression"],
                "additionalProperties": False,
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'arithmetic with numbers, + - * / // % ** and parentheses, e.g. "123*456"',
                    }
                },
            },
        },
    }
    lookup = schemas["lookup"]["function"]["parameters"]
    assert lookup["required"] == ["key"] and lookup["properties"]["default"] == {
        "type": "string",
        "description": "what to answer for an unknown word",
    }
    assert schemas["stats"]["function"]["parameters"]["properties"] == {
        "values": {"type": "array", "items": {"type": "number"}},
        "kind": {"enum": ["sum", "max"]},
    }
    prompt = env.system_prompt("You are a helpful assistant.")
    assert prompt.startswith("You are a helpful assistant.\n\n# Tools")
    listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["calculator", "lookup", "stats"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    assert '<call>\n{"name": <function-name>' in tools_system_prompt([], start="<call>", end="</call>")


def test_config_is_validated_and_the_environment_is_registered(helpers_on_path):
    problems = ToolsEnvParams(
        tools=["calculator", "calculator", "bogus"], tool_timeout_s=0, max_tool_calls_per_turn=0
    ).validate()
    assert problems == [
        "tools[2]: 'bogus' is neither a built-in (calculator, python) nor 'module:function'",
        "tools: listed more than once",
        "tool_timeout_s: must be > 0",
        "max_tool_calls_per_turn: must be >= 1",
    ]
    with pytest.raises(ModuleNotFoundError):
        ToolsEnvironment(ToolsEnvParams(tools=["no_such_module_xyz:f"]))
    registration = get_plugin_manager().registration("environment", "tools")
    assert registration.config is ToolsEnvParams
    env = registration.factory(ToolsEnvParams(tools=["agent_tool_funcs:lookup"]), None)
    assert list(env.tools()) == ["lookup"]
    duplicate = ToolsEnvironment(ToolsEnvParams(tools=["calculator", "agent_tool_funcs:lookup"]))
    duplicate._local.append(tool_from_callable(lambda key: key, name="lookup"))
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        duplicate.tools()


def test_params_load_through_the_run_config():
    from relax.core.config import config_from_dict, quickstart_dict

    data = quickstart_dict()
    data["environment"] = {
        "name": "tools",
        "tool_parser": "hermes",
        "params": {
            "tools": ["calculator", "python"],
            "answer": "numeric",
            "sandbox": {"wall_s": 3, "memory_mb": 256},
            "mcp_servers": [{"name": "srv", "command": ["python", "server.py"], "env": {"A": "1"}}],
        },
    }
    cfg = config_from_dict(data)
    params = cfg.environment.params
    assert (
        isinstance(params, ToolsEnvParams)
        and params.sandbox.wall_s == 3.0
        and params.sandbox.memory_mb == 256
    )
    assert params.mcp_servers[0].command == ["python", "server.py"] and params.mcp_servers[0].env == {
        "A": "1"
    }
    data["environment"]["params"]["tool_timeout_s"] = 30.0  # cannot fit turn_timeout_s (30s by default)
    with pytest.raises(
        Exception, match=r"tool_timeout_s: 30s plus 1s to report must fit environment.turn_timeout_s \(30s\)"
    ):
        config_from_dict(data)
    data["environment"]["params"] = {
        "tools": ["calculator"],
        "answer": "fuzzy",
        "mcp_servers": [{"name": "x"}],
    }
    with pytest.raises(Exception, match="answer") as info:
        config_from_dict(data)
    assert "'fuzzy' is not allowed" in str(info.value)
