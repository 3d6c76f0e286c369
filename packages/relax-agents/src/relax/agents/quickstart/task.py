"""The agent quick-start's task: products of two 3-digit numbers, which need the ``calculator`` tool.

A row is ``{"prompt": "123*456=", "label": "56088"}``. The product has 5-6 digits, so a policy that
answers without the tool is right about one time in 10^5: the reward can only come from calling
the calculator and copying its result.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

TOOL_NAME = "calculator"


def problem(rng: random.Random) -> tuple[int, int]:
    return rng.randint(100, 999), rng.randint(100, 999)


def problem_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` seeded rows ``{"prompt": "a*b=", "label": "a*b's value"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = problem(rng)
        rows.append({"prompt": f"{a}*{b}=", "label": str(a * b)})
    return rows


def tool_call_text(expression: str) -> str:
    """The Hermes call the policy writes (what the ``hermes`` tool parser reads back)."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {arguments}}}</tool_call>'


def write_rows(path: str | os.PathLike[str], rows: list[dict[str, str]]) -> str:
    """Write JSONL aside and rename into place: a concurrent reader never sees a partial file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    part.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(part, target)
    return str(target)
