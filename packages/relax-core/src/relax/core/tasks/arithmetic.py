"""The quick-start task: one-step arithmetic prompts such as ``"3+4="`` with label ``"7"``.

It is written to JSONL (fields ``prompt``/``label``) so the quick-start reads it through the same
``PromptDataset`` path as user data. Answers default to one digit so a tiny model can learn the
task on CPU in minutes and the reward visibly rises.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


def _problems(max_operand: int, ops: Sequence[str], max_answer: int) -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) with operands in 0..max_operand and answer in 0..max_answer."""
    unknown = [op for op in ops if op not in _OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)}")
    out = []
    for op in dict.fromkeys(ops):  # de-duplicate, keep order
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                ans = _OPS[op](a, b)
                if 0 <= ans <= max_answer:
                    out.append((a, op, b, ans))
    if not out:
        raise ValueError(
            f"no problems with max_operand={max_operand}, max_answer={max_answer}, ops={list(ops)}"
        )
    return out


def heldout_problems(
    count: int, seed: int = 0, max_operand: int = 9, ops: Sequence[str] = ("+",), max_answer: int = 9
) -> list[tuple[int, str, int, int]]:
    """``count`` problems kept out of training (a held-out split), chosen by ``seed`` among the sums ``a+b``
    with ``a < b``: each one's mirror ``b+a`` stays in training, so a model that learnt the sums, not the
    prompts, can answer it. Sorted; empty for ``count`` 0."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    candidates = [p for p in _problems(max_operand, ops, max_answer) if p[1] == "+" and p[0] < p[2]]
    if count > len(candidates):
        raise ValueError(f"only {len(candidates)} problems can be held out (a+b with a<b), asked for {count}")
    return sorted(random.Random(f"heldout/{seed}").sample(candidates, count))


def heldout_rows(
    count: int, seed: int = 0, max_operand: int = 9, ops: Sequence[str] = ("+",), max_answer: int = 9
) -> list[dict[str, str]]:
    """Each held-out problem once, as rows like :func:`arithmetic_rows`'."""
    return [
        {"prompt": f"{a}{op}{b}=", "label": str(ans)}
        for a, op, b, ans in heldout_problems(count, seed, max_operand, ops, max_answer)
    ]


def arithmetic_rows(
    num_examples: int,
    seed: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    max_answer: int = 9,
    heldout: int = 0,
) -> list[dict[str, str]]:
    """``num_examples`` rows ``{"prompt": "a<op>b=", "label": "<answer>"}`` drawn uniformly (with
    replacement) from all valid problems but the ``heldout`` ones (:func:`heldout_problems`); identical
    for identical arguments."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    held = set(heldout_problems(heldout, seed, max_operand, ops, max_answer))
    problems = [p for p in _problems(max_operand, ops, max_answer) if p not in held]
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, op, b, ans = problems[rng.randrange(len(problems))]
        rows.append({"prompt": f"{a}{op}{b}=", "label": str(ans)})
    return rows


def write_arithmetic_jsonl(
    path: str | Path,
    n: int,
    seed: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    max_answer: int = 9,
    heldout: int = 0,
) -> Path:
    """Write ``arithmetic_rows(n, seed, ...)`` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = arithmetic_rows(n, seed, max_operand, ops, max_answer, heldout)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
