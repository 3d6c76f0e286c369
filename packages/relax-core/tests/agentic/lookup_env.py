"""A real tiny environment plugin, written as a user writes one from docs/agents.md: a ``lookup(key)`` tool
task. The policy's first turn gets the tool's answer as an observation; its second ends the episode with
reward 1.0. ``fault`` makes the episodes of ``fault_on_index`` (every sample when None) misbehave the way
issue 42 found invisible: a tool that raises, hangs or spins, observations of the wrong shape."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from relax.core.hookspecs import hookimpl
from relax.core.protocols import StepResult, ToolCall, Turn

FAULTS = (
    "none",
    "raise",
    "hang",
    "spin",
    "none_content",
    "int_content",
    "none_observations",
    "str_observations",
    "tool_failure",
)
#: set by a spinning episode's thread when it stops (the test waits for it)
SPIN_STOPPED = threading.Event()
TABLE = {"relax": "an RL engine"}


@dataclass(frozen=True)
class LookupParams:
    fault: str = "none"
    fault_on_index: int | None = None  # only this index_in_group misbehaves; None: every sample

    def validate(self) -> list[str]:
        return [] if self.fault in FAULTS else [f"fault: {self.fault!r} is not one of {FAULTS}"]


def lookup(key: str) -> str:
    """The tool: a word's meaning."""
    return TABLE.get(key, "?")


class LookupEpisode:
    def __init__(self, fault: str) -> None:
        self.fault = fault

    def step(self, turn: Turn) -> StepResult:
        if turn.index >= 1:
            return StepResult(done=True, reward=1.0)
        fault = self.fault
        if fault == "raise":
            raise RuntimeError("lookup table is gone")
        if fault == "hang":
            time.sleep(3600)
        if fault == "spin":  # a busy loop: only an interrupt stops it
            n = 0
            try:
                while True:
                    n += 1
            finally:
                SPIN_STOPPED.set()
        observations: object = [{"role": "user", "content": lookup("relax")}]
        if fault == "none_content":
            observations = [{"role": "user", "content": None}]
        elif fault == "int_content":
            observations = [{"role": "user", "content": 42}]
        elif fault == "none_observations":
            observations = None
        elif fault == "str_observations":
            observations = "an RL engine"
        failures = ["tool 'lookup' raised KeyError: 'relax'"] if fault == "tool_failure" else []
        return StepResult(observations, info={"lookups": 1.0}, failures=failures)  # type: ignore[arg-type]

    def close(self) -> None:
        pass


class LookupEnvironment:
    def __init__(self, params: LookupParams) -> None:
        self.params = params

    def start(self, sample) -> LookupEpisode:
        on = self.params.fault_on_index
        return LookupEpisode(self.params.fault if on is None or sample.index_in_group == on else "none")


class LookupCalls:
    """The task's own tool parser: ``lookup(word)`` in a turn is a call."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        import re

        calls = [ToolCall("lookup", {"key": m}) for m in re.findall(r"lookup\((\w+)\)", text)]
        return re.sub(r"lookup\(\w+\)", "", text), calls


@hookimpl
def relax_register_tool_parsers(register):
    register("lookup_calls", lambda params, ctx: LookupCalls())


@hookimpl
def relax_register_environments(register):
    # the policy answers with tool calls: `relax validate` refuses environment.tool_parser: none
    register("lookup", lambda params, ctx: LookupEnvironment(params), config=LookupParams, tool_calls=True)


@hookimpl
def relax_on_step_end(step, metrics):
    pass
