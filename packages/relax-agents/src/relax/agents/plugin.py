"""relax-agents' registrations (``relax`` entry point): environments and tool-call parsers."""

from __future__ import annotations

from relax.core.hookspecs import hookimpl


@hookimpl
def relax_register_environments(register):
    pass


@hookimpl
def relax_register_tool_parsers(register):
    pass
