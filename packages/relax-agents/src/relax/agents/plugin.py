"""relax-agents' registrations (``relax`` entry point): environments and tool-call parsers.

Factories import their modules lazily, so listing plugins never starts anything heavy. One
``register`` line per environment or parser; add yours the same way.
"""

from __future__ import annotations

from typing import Any

from relax.core.hookspecs import hookimpl


def _tools_environment(params: Any, ctx: Any) -> Any:
    from relax.agents.tools_env import tools_environment

    return tools_environment(params, ctx)


def _openai_agent_environment(params: Any, ctx: Any) -> Any:
    from relax.agents.openai_env import openai_agent_environment

    return openai_agent_environment(params, ctx)


def _verifiers_environment(params: Any, ctx: Any) -> Any:
    from relax.agents.verifiers_env import verifiers_environment

    return verifiers_environment(params, ctx)


def _hermes_parser(params: Any, ctx: Any) -> Any:
    from relax.agents.parsers import hermes_parser

    return hermes_parser(params, ctx)


@hookimpl
def relax_register_environments(register):
    from relax.agents.config import ToolsEnvParams

    # tool_calls=True: the policy answers with tool calls, so `relax validate` refuses environment.tool_parser: none
    register("tools", _tools_environment, config=ToolsEnvParams, tool_calls=True)
    # light imports (stdlib + relax.core): openai and verifiers load only when an episode runs
    from relax.agents.openai_env import OpenAIAgentParams
    from relax.agents.verifiers_env import VerifiersParams

    register("openai_agent", _openai_agent_environment, config=OpenAIAgentParams)
    register("verifiers", _verifiers_environment, config=VerifiersParams)


@hookimpl
def relax_register_tool_parsers(register):
    from relax.agents.config import HermesParams

    register("hermes", _hermes_parser, config=HermesParams)


@hookimpl
def relax_register_commands(register):
    from relax.agents.quickstart import command

    register("agent-quickstart", command.handler, help=command.HELP, arguments=command.arguments)


def _agent_quickstart_inputs(params: Any, ctx: Any) -> dict[str, str]:
    from pathlib import Path

    from relax.agents.quickstart import ensure_agent_model, ensure_task_data

    data = Path(ctx.run_dir) / "data" / "train.jsonl"
    return {
        "model.path": ensure_agent_model(),
        "data.path": ensure_task_data(data, n=params.rows, seed=params.seed),
    }


@hookimpl
def relax_register_inputs(register):
    from relax.agents.quickstart.build import QuickstartInputs

    # examples/quickstart_agent*.yaml: the warmed-up tiny model (cached) and the task data, built on first use
    register(
        "agent_quickstart",
        _agent_quickstart_inputs,
        config=QuickstartInputs,
        fills=("model.path", "data.path"),
    )
