"""Typed config of relax-agents' plugins: plain dataclasses, nothing heavy imported (the plugin
manager imports them to register, in every process and for ``relax plugins``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

BUILTIN_TOOLS = ("calculator", "python")
#: beyond ``tool_timeout_s``, for tools that enforce it themselves (the sandbox, MCP) to say how a call ended
REPORT_GRACE_S = 1.0


@dataclass(frozen=True)
class HermesParams:
    """``environment.tool_parser_params`` of the ``hermes`` parser (defaults: Qwen2.5/Qwen3, Hermes)."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def validate(self) -> list[str]:
        return [f"{key}: must not be empty" for key in ("start", "end") if not getattr(self, key)]


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one ``python`` tool call (``relax.agents.sandbox``)."""

    wall_s: float = 10.0  # killed after this long
    cpu_s: int = 5  # CPU seconds (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 512  # address space
    max_processes: int = 16  # processes/threads the call may run at once (forks beyond fail)
    max_output_bytes: int = 8192  # of stdout (its start) and of stderr (its end) returned to the policy
    max_file_mb: int = 16  # largest file the code may write
    network: bool = False  # True: leave the network reachable
    restrict_files: bool = True  # Landlock: read only Python and system libraries, write only the work dir


@dataclass(frozen=True)
class MCPServerParams:
    """One entry of ``environment.params.mcp_servers``: a stdio MCP server."""

    name: str  # names the server in errors and logs
    command: list[str] = field(default_factory=list)  # argv, e.g. ["python", "-m", "my_server"]
    env: dict[str, str] = field(default_factory=dict)  # extra environment (PATH, HOME, ... are passed on)
    cwd: str | None = None
    tool_prefix: str = ""  # prepended to the server's tool names (to tell two servers' tools apart)
    start_timeout_s: float = 30.0

    def validate(self) -> list[str]:
        return [] if self.command else ["command: an MCP server needs a command (argv list)"]


@dataclass(frozen=True)
class ToolsEnvParams:
    """``environment.params`` of the ``tools`` environment."""

    #: built-ins (``calculator``, ``python``) or ``"package.module:function"`` (any Python callable)
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    mcp_servers: list[MCPServerParams] = field(
        default_factory=list
    )  # stdio MCP servers whose tools are callable
    answer: Literal["exact_match", "numeric", "none"] = "exact_match"  # none: no reward from the episode
    numeric_mode: Literal["first", "last", "answer"] = "answer"  # which number of the answer counts
    abs_tol: float = 1e-6
    case_sensitive: bool = False
    tool_timeout_s: float = (
        5.0  # one tool call (the calls of a turn run at once); below environment.turn_timeout_s
    )
    max_tool_calls_per_turn: int = 4  # calls beyond this get an error observation, unrun
    #: process: each function-tool call runs in a worker process, killed when it overruns tool_timeout_s (a hung
    #: tool stops using CPU); thread: in the driver (a tool that needs in-process state; an overrun is abandoned)
    tool_workers: Literal["process", "thread"] = "process"
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # limits of the ``python`` tool

    def validate(self) -> list[str]:
        errors = [
            f"tools[{i}]: {t!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) nor 'module:function'"
            for i, t in enumerate(self.tools)
            if t not in BUILTIN_TOOLS and t.count(":") != 1
        ]
        if len(set(self.tools)) != len(self.tools):
            errors.append("tools: listed more than once")
        if self.tool_timeout_s <= 0:
            errors.append("tool_timeout_s: must be > 0")
        if self.max_tool_calls_per_turn < 1:
            errors.append("max_tool_calls_per_turn: must be >= 1")
        for i, server in enumerate(self.mcp_servers):
            errors += [f"mcp_servers[{i}].{e}" for e in server.validate()]
        return errors

    def validate_run(self, cfg: Any) -> list[str]:
        """A step runs its calls at once, each bounded by ``tool_timeout_s``: core's bound on the whole
        step must leave room for them, or every slow call would end its episode instead of being observed."""
        turn_timeout_s = cfg.environment.turn_timeout_s
        if self.tool_timeout_s + REPORT_GRACE_S > turn_timeout_s:
            return [
                f"environment.params.tool_timeout_s: {self.tool_timeout_s:g}s plus {REPORT_GRACE_S:g}s to report must fit "
                f"environment.turn_timeout_s ({turn_timeout_s:g}s); lower it or raise turn_timeout_s"
            ]
        return []
