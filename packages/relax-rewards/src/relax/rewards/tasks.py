"""The math quick-start task: ``"a+b="`` and ``"a/b="`` prompts with answers written as ``\\boxed{}``.

Sums have integer answers (``\\boxed{7}``); quotients have fraction answers (``\\boxed{\\frac{8}{4}}``)
whose value is an integer, so the quick-start's digit-only model can answer them and math-verify
must prove ``2 = 8/4``. ``data_source`` (``add`` / ``div``) lets the hub route and report per route.

``python -m relax.rewards.tasks examples/data/quickstart_math.jsonl`` writes the example's file.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def math_rows(n: int = 400, seed: int = 0, max_operand: int = 9) -> list[dict[str, str]]:
    """``n`` rows drawn uniformly (with replacement) from all sums and exact quotients."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    problems = [
        (f"{a}+{b}=", f"\\boxed{{{a + b}}}", "add")
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    problems += [
        (f"{a * b}/{b}=", f"\\boxed{{\\frac{{{a * b}}}{{{b}}}}}", "div")
        for a in range(1, max_operand + 1)
        for b in range(2, max_operand + 1)
        if a * b < 100
    ]
    rng = random.Random(seed)
    return [
        dict(zip(("prompt", "label", "data_source"), problems[rng.randrange(len(problems))], strict=True))
        for _ in range(n)
    ]


def write_math_jsonl(path: str | Path, n: int = 400, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in math_rows(n, seed)), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_math_jsonl(sys.argv[1] if len(sys.argv) > 1 else "examples/data/quickstart_math.jsonl"))
