"""A tiny MCP stdio server for the tests: ``add``, ``fail`` (raises), ``slow`` and ``pid``."""

from __future__ import annotations

import os
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("relax-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Always raises (a tool error the episode must turn into an error observation)."""
    raise RuntimeError(f"fail was asked to fail: {message}")


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer (for timeouts)."""
    time.sleep(seconds)
    return "done"


@server.tool()
def pid() -> int:
    """This server's process id (to check it is stopped)."""
    return os.getpid()


if __name__ == "__main__":
    server.run("stdio")
