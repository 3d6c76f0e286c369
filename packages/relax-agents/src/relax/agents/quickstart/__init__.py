"""The agent quick-start: a tiny model learns, by RL, to call a calculator for 3-digit products.

``prepare()`` (the ``relax agent-quickstart`` command) writes what ``examples/quickstart_agent.yaml``
points at: the warmed-up tiny model and the task data. Both are deterministic and built once.
"""

from relax.agents.quickstart.build import (
    DEFAULT_DATA,
    DEFAULT_MODEL,
    ensure_agent_model,
    ensure_task_data,
    prepare,
    recipe_fingerprint,
)

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "ensure_agent_model",
    "ensure_task_data",
    "prepare",
    "recipe_fingerprint",
]
