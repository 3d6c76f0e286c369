"""MCP stdio servers as tools: round trip, errors, timeouts, and no server left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relax.agents.config import MCPServerParams, ToolsEnvParams
from relax.agents.tools_env import ToolsEnvironment
from relax.core.data import Sample
from relax.core.protocols import ToolCall, Turn

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")


def _step(env, *calls: ToolCall):
    return env.start(Sample(prompt_ids=[1], group_id=0, label="5")).step(Turn(0, "", [], list(calls), "stop"))


def test_mcp_tools_round_trip_and_the_server_stops_at_close():
    params = ToolsEnvParams(
        tools=["calculator"],
        tool_timeout_s=1.0,
        max_tool_calls_per_turn=6,
        mcp_servers=[MCPServerParams("test", SERVER, env={"RELAX_TEST": "1"}, tool_prefix="t_")],
    )
    env = ToolsEnvironment(params)
    assert env._mcp is not None and env._mcp._loop is None  # nothing started before it is needed
    try:
        schemas = {s["function"]["name"]: s["function"] for s in env.tool_schemas()}
        assert sorted(schemas) == ["calculator", "t_add", "t_fail", "t_pid", "t_slow"]
        assert schemas["t_add"]["description"] == "Add two integers."
        assert schemas["t_add"]["parameters"]["required"] == ["a", "b"]
        result = _step(
            env,
            ToolCall("t_add", {"a": 2, "b": 3}),
            ToolCall("t_fail", {"message": "on purpose"}),
            ToolCall("t_add", {"a": "x", "b": 1}),
            ToolCall("t_slow", {"seconds": 30}),
            ToolCall("calculator", {"expression": "2+3"}),
            ToolCall("t_pid", {}),
        )
        texts = [o["content"] for o in result.observations]
        assert texts[0] == "5" and texts[4] == "5"
        assert (
            texts[1].startswith("Error: tool 't_fail' failed:")
            and "fail was asked to fail: on purpose" in texts[1]
        )
        assert texts[2].startswith("Error: bad arguments for tool 't_add': a: 'x' is not of type 'integer'")
        assert texts[3] == "Error: tool 't_slow' failed: MCP tool 'slow' did not answer within 1s"
        assert result.info["tool_calls_ok"] == 3.0 and result.info["tool_errors"] == 3.0
        pid = int(texts[5])
        assert _alive(pid)
    finally:
        started = time.monotonic()
        env.close()
    assert time.monotonic() - started < 15
    assert not _alive(pid)


DRIVER = textwrap.dedent("""
    import sys, time
    from relax.agents.config import MCPServerParams
    from relax.agents.mcp_tools import MCPServers
    servers = MCPServers([MCPServerParams("test", {server!r})])
    pid = next(t for t in servers.tools() if t.name == "pid")({{}})
    print(pid, flush=True)
    time.sleep(120)
""")


def test_a_killed_driver_leaves_no_server_behind():
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(server=SERVER)], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(json.loads(driver.stdout.readline()))
        assert _alive(pid)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the MCP server outlived its killed driver"


def test_a_server_that_does_not_start_is_a_clear_error_once():
    broken = MCPServerParams(
        "broken",
        [sys.executable, "-c", "import sys; print('no such tool server', file=sys.stderr); sys.exit(3)"],
        start_timeout_s=20,
    )
    env = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], mcp_servers=[broken]))
    missing = ToolsEnvironment(
        ToolsEnvParams(mcp_servers=[MCPServerParams("gone", ["/nonexistent/mcp-server"])])
    )
    try:
        for _ in range(2):  # the failed start is remembered, not retried by every episode
            with pytest.raises(RuntimeError, match=r"^MCP server 'broken' \(.*\) did not start") as info:
                env.tools()
            assert "no such tool server" in str(info.value)  # its stderr, to say why
        assert len(env._mcp._tasks) == 1
        with pytest.raises(
            RuntimeError, match=r"MCP server 'gone' \(/nonexistent/mcp-server\) did not start"
        ):
            missing.tools()
    finally:
        env.close()
        missing.close()
