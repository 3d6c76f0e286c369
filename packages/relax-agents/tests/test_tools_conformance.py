"""The ``tools`` environment passes core's ``EnvironmentConformance`` kit."""

from __future__ import annotations

from relax.agents.config import ToolsEnvParams
from relax.agents.tools_env import ToolsEnvironment
from relax.core.protocols import ToolCall
from relax.core.testing.environment import EnvironmentConformance, make_turn, malformed_turn


class TestToolsEnvironment(EnvironmentConformance):
    def make_environment(self):
        return ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="numeric", tool_timeout_s=2.0))

    def policy_turns(self, sample):
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        return [
            malformed_turn(),
            make_turn(call, [ToolCall("calculator", {"expression": "6*7"}, raw=call)]),
            make_turn(f"The answer is {sample.label}."),
        ]

    def expected_rewards(self):
        return [1.0, 1.0, 1.0, 1.0]
