"""Relax agents: environments and tools for multi-turn rollouts (``relax.core.agentic``)."""
