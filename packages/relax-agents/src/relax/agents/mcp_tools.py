"""Tools from Model Context Protocol servers over stdio (the ``mcp`` package's client).

Episodes step in plain threads, the MCP client is async: one event loop in a daemon thread holds
every server's session, and calls cross into it with ``run_coroutine_threadsafe`` under a timeout.
Servers start on first use (listing or calling a tool) and stop at :meth:`MCPServers.close`, which
also runs at interpreter exit. Each server runs in its own session and exits when its stdin closes,
so even a killed driver leaves no server behind (the ``mcp`` stdio transport kills the whole
process group of a server that does not exit).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from relax.agents.config import MCPServerParams
from relax.agents.tools import ToolError


@dataclass(frozen=True)
class MCPTool:
    """A tool of a running MCP server, as the ``tools`` environment calls it."""

    name: str
    description: str
    parameters: dict[str, Any]
    servers: MCPServers
    server: str
    remote_name: str
    timeout_s: float

    def __call__(self, arguments: dict[str, Any]) -> Any:
        return self.servers.call(self.server, self.remote_name, arguments, self.timeout_s)


class MCPServers:
    """The stdio servers of one environment, started together on first use."""

    def __init__(self, specs: list[MCPServerParams], call_timeout_s: float = 30.0) -> None:
        self.specs, self.call_timeout_s = list(specs), call_timeout_s
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, Any] = {}
        self._tools: list[MCPTool] | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[Any] = []
        self._closed = False
        self._error = ""
        self._logs = tempfile.TemporaryDirectory(prefix="relax-mcp-")
        #: what the finalizer needs to stop everything (no reference to ``self``); it also runs at exit
        self._shared: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _shutdown, self._shared)

    # ------------------------------------------------------------------ start
    def tools(self) -> list[MCPTool]:
        """Every server's tools (starting the servers the first time)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("MCP servers already closed")
            if self._error:  # a failed start is not retried by every episode: each gets the same error
                raise RuntimeError(self._error)
            if self._tools is None:
                try:
                    self._tools = self._start()
                except RuntimeError as exc:
                    self._error = str(exc)
                    _shutdown(self._shared)  # the servers that did start
                    raise
            return list(self._tools)

    def _start(self) -> list[MCPTool]:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True, name="relax-mcp")
        thread.start()
        self._loop = loop
        self._shared.update(loop=loop, thread=thread, tasks=self._tasks)
        self._stop = asyncio.run_coroutine_threadsafe(_make_event(), loop).result()
        self._shared["stop"] = self._stop
        tools: list[MCPTool] = []
        for spec in self.specs:
            ready: asyncio.Future = asyncio.run_coroutine_threadsafe(_make_future(), loop).result()
            task = asyncio.run_coroutine_threadsafe(self._serve(spec, ready), loop)
            self._tasks.append(task)
            try:
                listing = asyncio.run_coroutine_threadsafe(_await(ready), loop).result(spec.start_timeout_s)
            except Exception as exc:
                try:
                    detail = open(self._log_path(spec), errors="replace").read()[-800:].strip()
                except OSError:
                    detail = ""
                raise RuntimeError(
                    f"MCP server {spec.name!r} ({' '.join(spec.command)}) did not start: "
                    f"{type(exc).__name__}: {exc}" + (f"\nits stderr:\n{detail}" if detail else "")
                ) from exc
            for tool in listing:
                tools.append(
                    MCPTool(
                        spec.tool_prefix + tool.name,
                        tool.description or "",
                        dict(tool.input_schema),
                        self,
                        spec.name,
                        tool.name,
                        self.call_timeout_s,
                    )
                )
        return tools

    def _log_path(self, spec: MCPServerParams) -> str:
        return f"{self._logs.name}/{spec.name}.stderr"

    async def _serve(self, spec: MCPServerParams, ready: asyncio.Future) -> None:
        """Hold one server's session open until close (enter and exit in the same task, as anyio needs)."""
        from mcp import StdioServerParameters, stdio_client
        from mcp.client import Client

        params = StdioServerParameters(
            command=spec.command[0],
            args=list(spec.command[1:]),
            env=dict(spec.env) or None,
            cwd=spec.cwd,
            encoding_error_handler="replace",
        )
        try:
            with open(self._log_path(spec), "w") as errlog:
                async with Client(stdio_client(params, errlog=errlog)) as client:
                    listing = await client.list_tools()
                    tools = list(listing.tools)
                    while listing.next_cursor:
                        listing = await client.list_tools(cursor=listing.next_cursor)
                        tools += listing.tools
                    self._clients[spec.name] = client
                    ready.set_result(tools)
                    await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise

    # ------------------------------------------------------------------ calls
    def call(self, server: str, tool: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        """The tool's text (text parts joined; other parts named); an ``is_error`` result raises ToolError."""
        client, loop = self._clients.get(server), self._loop
        if client is None or loop is None or self._closed:
            raise ToolError(f"MCP server {server!r} is not running")
        future = asyncio.run_coroutine_threadsafe(
            client.call_tool(tool, arguments, read_timeout_seconds=timeout_s), loop
        )
        try:
            result = future.result(timeout_s + 1.0)
        except TimeoutError:
            future.cancel()
            raise ToolError(f"MCP tool {tool!r} did not answer within {timeout_s:g}s") from None
        except Exception as exc:  # the protocol's errors (a read timeout, a dead server) name the call
            if "timed out" in str(exc):
                raise ToolError(f"MCP tool {tool!r} did not answer within {timeout_s:g}s") from None
            raise ToolError(f"MCP tool {tool!r} on server {server!r} failed: {exc}") from None
        parts = []
        for block in result.content:
            text = getattr(block, "text", None)
            parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')} content]")
        text = "\n".join(parts)
        if not parts and result.structured_content is not None:
            return result.structured_content
        if result.is_error:
            raise ToolError(text or f"MCP tool {tool!r} failed")
        return text

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        """Stop every server (bounded: the stdio transport terminates a server that lingers)."""
        with self._lock:
            self._closed = True
        self._finalizer()
        self._logs.cleanup()


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _make_future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


async def _await(future: asyncio.Future) -> Any:
    return await future


def _shutdown(shared: dict[str, Any], timeout_s: float = 10.0) -> None:
    loop, stop = shared.get("loop"), shared.get("stop")
    if loop is None or loop.is_closed():
        return
    if stop is not None:
        loop.call_soon_threadsafe(stop.set)
    for task in shared.get("tasks", []):
        try:
            task.result(timeout_s)
        except Exception:  # noqa: BLE001 - a server that failed to start or stop is already reported
            pass
    loop.call_soon_threadsafe(loop.stop)
    shared["thread"].join(timeout_s)
    if not loop.is_running():
        loop.close()
