"""DAPO-Math-17k (``BytedTsinghua-SIA/DAPO-Math-17k``) -> Relax rows for the ``math`` reward.

Published schema (one Parquet file, ``data/dapo-math-17k.parquet``): ``data_source`` ("math_dapo"),
``prompt`` (chat messages ``[{content, role}]`` whose user turn asks for the final answer on a last line
"Answer: $Answer"), ``ability``, ``reward_model`` ``{ground_truth, style}``, ``extra_info`` ``{index}``. The
file repeats each of its ~17.4k problems about 100 times: duplicates (same prompt and answer) are dropped
and counted. The flat ``{prompt, label}`` JSONL copies of it (e.g. ``zhuzilin/dapo-math-17k``) convert too.

Relax row: ``{"prompt": [messages as published], "label": ground_truth, "data_source", "index"}`` --
``math`` finds the last "Answer:" phrase (or ``\\boxed{}``) and checks it with math-verify.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax.core.recipes import Output, RowError, SourceRow

NAME = "dapo-math-17k"
HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"


def _messages(prompt: Any) -> list[dict[str, str]]:
    if isinstance(prompt, str) and prompt.strip():
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise RowError(
            "prompt is not a chat message list", "empty list" if prompt == [] else f"got {prompt!r:.60}"
        )
    messages = []
    for m in prompt:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise RowError("prompt is not a chat message list", f"message {m!r:.60}")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise RowError("prompt has no user text")
    return messages


def convert(src: SourceRow, out: Output) -> tuple[dict[str, Any], str]:
    """One published row -> (Relax row, duplicate key)."""
    row = src.row
    messages = _messages(row.get("prompt"))
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else row.get("label")
    if truth is None or not str(truth).strip():
        raise RowError("no answer (reward_model.ground_truth)")
    label = str(truth).strip()
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    converted = {
        "prompt": messages,
        "label": label,
        "data_source": row.get("data_source") or "math_dapo",
        "index": extra.get("index"),
    }
    return converted, json.dumps([messages, label])


# --------------------------------------------------------------------------- fixture rows

_ASK = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
_PROBLEMS = [
    ("What is 3+4?", "7"),
    ("What is 2*6?", "12"),
    ("What is 9-5?", "4"),
    ("What is 8+8?", "16"),
    ("What is half of 10?", "5"),
    ("What is 7*3?", "21"),
    ("What is 1+1?", "2"),
    ("What is 6-6?", "0"),
]


def fixture_rows(rows: int) -> list[dict[str, Any]]:
    """``rows`` good rows in the published schema, then the kinds of bad row a converter must survive: a
    duplicate (as the file has ~100 of each), no ground truth, a prompt that is not a message list."""
    good = []
    for i in range(rows):
        problem, answer = _PROBLEMS[i % len(_PROBLEMS)]
        problem = problem if i < len(_PROBLEMS) else f"{problem} (variant {i})"
        good.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"content": _ASK.format(problem), "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"fixture-{i:04d}"},
            }
        )
    no_truth = {
        **good[0],
        "reward_model": {"ground_truth": "", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "fixture-bad-1"},
    }
    no_prompt = {**good[0], "prompt": [], "extra_info": {"index": "fixture-bad-2"}}
    return [*good, good[0], no_truth, no_prompt]


def write_fixture(directory: Path, rows: int) -> Path:
    """The published layout: ``<directory>/data/dapo-math-17k.parquet``; returns ``directory``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )
    (directory / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(fixture_rows(rows), schema=schema), directory / "data" / "dapo-math-17k.parquet"
    )
    return directory
