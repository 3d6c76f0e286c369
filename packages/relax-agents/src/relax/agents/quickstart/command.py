"""``relax agent-quickstart``: build what ``examples/quickstart_agent*.yaml`` point at, once."""

from __future__ import annotations

import argparse

from relax.agents.quickstart.build import DEFAULT_DATA, DEFAULT_MODEL

HELP = "build the agent quick-start's warmed-up tiny model and task data (seeded, cached)"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir", default=DEFAULT_MODEL, help=f"where the model goes (default {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--data", default=DEFAULT_DATA, help=f"where the task JSONL goes (default {DEFAULT_DATA})"
    )


def handler(ns: argparse.Namespace) -> int:
    from relax.agents.quickstart.build import prepare

    model_dir, data = prepare(ns.model_dir, ns.data)
    print(f"model: {model_dir}\ndata:  {data}\nnext:  relax run examples/quickstart_agent.yaml")
    return 0
