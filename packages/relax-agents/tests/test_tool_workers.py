"""Issue 42: a function tool that overruns ``tool_timeout_s`` is killed with its worker process (its CPU is
freed), not left running in an abandoned thread; its failure is reported to core (``StepResult.failures``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from relax.agents.config import ToolsEnvParams
from relax.agents.tools_env import ToolsEnvironment
from relax.core.data import Sample
from relax.core.protocols import ToolCall, Turn

SAMPLE = Sample(prompt_ids=[1], group_id=0)
FUNCS = [
    "agent_tool_funcs:lookup",
    "agent_tool_funcs:spin",
    "agent_tool_funcs:crash",
    "agent_tool_funcs:explode",
]


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the worker processes import the tools as here
    monkeypatch.setenv("SPIN_PID_FILE", str(tmp_path / "spin.pid"))
    environment = ToolsEnvironment(ToolsEnvParams(tools=FUNCS, tool_timeout_s=0.5, answer="none"))
    yield environment
    environment.close()


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` from /proc, None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_spinning_tool_is_killed_and_its_cpu_freed(env, tmp_path):
    turn = Turn(0, "", [], [ToolCall("spin", {"seconds": 3600})], "stop")
    result = env.start(SAMPLE).step(turn)
    assert result.observations == [
        {"role": "tool", "content": "Error: tool 'spin' did not finish within 0.5s."}
    ]
    assert result.info["tool_timeouts"] == 1.0
    assert result.failures == [
        "tool 'spin' did not finish within 0.5s."
    ]  # reported to core (console, failures.jsonl)
    pid = int((tmp_path / "spin.pid").read_text())
    assert pid != os.getpid()  # it ran in a worker process
    assert _cpu_seconds(pid) is None  # killed and reaped: it uses no more CPU
    assert pid not in env._workers.pids()


def test_workers_are_reused_and_a_crash_or_an_exception_is_named(env):
    episode = env.start(SAMPLE)
    first = episode.step(Turn(0, "", [], [ToolCall("lookup", {"key": "relax"})], "stop"))
    pids = env._workers.pids()
    again = episode.step(Turn(1, "", [], [ToolCall("lookup", {"key": "relax"})], "stop"))
    assert first.observations == again.observations == [{"role": "tool", "content": "an RL engine"}]
    assert len(pids) == 1 and env._workers.pids() == pids  # one idle worker, reused: a call is a round trip
    crashed = episode.step(Turn(2, "", [], [ToolCall("crash", {"code": 3})], "stop"))
    assert (
        crashed.observations[0]["content"]
        == "Error: tool 'crash' crashed: its worker process died (exit code 3)"
    )
    raised = episode.step(Turn(3, "", [], [ToolCall("explode", {"reason": "no table"})], "stop"))
    assert (
        raised.observations[0]["content"]
        == "Error: tool 'explode' raised ValueError: exploded because no table"
    )
    assert raised.failures == ["tool 'explode' raised ValueError: exploded because no table"]
    env.close()
    deadline = time.monotonic() + 10
    while env._workers.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env._workers.pids() == [] and all(_cpu_seconds(p) is None for p in pids)


def test_a_tool_that_cannot_travel_to_a_worker_runs_in_a_thread(monkeypatch):
    from relax.agents.tools import tool_from_callable

    env = ToolsEnvironment(ToolsEnvParams(tools=[], answer="none"))
    local_state = []

    def remember(word: str) -> str:  # a closure: not picklable, so it runs in the driver, as before
        local_state.append(word)
        return "ok"

    env._local = [tool_from_callable(remember)]
    result = env.start(SAMPLE).step(Turn(0, "", [], [ToolCall("remember", {"word": "relax"})], "stop"))
    assert result.observations == [{"role": "tool", "content": "ok"}] and local_state == ["relax"]
    env.close()
