import json

import pytest

from relax.core.dataset import DatasetConfig, PromptDataset
from relax.core.tasks import arithmetic_rows, write_arithmetic_jsonl


def solve(prompt: str) -> int:
    assert prompt.endswith("=")
    for op in "+-":
        if op in prompt:
            a, b = prompt[:-1].split(op)
            return int(a) + int(b) if op == "+" else int(a) - int(b)
    raise AssertionError(prompt)


def test_rows_are_correct_single_digit_and_deterministic():
    rows = arithmetic_rows(500, seed=1)
    assert all(r["label"] == str(solve(r["prompt"])) for r in rows)
    assert {r["label"] for r in rows} == {str(d) for d in range(10)}  # every answer 0..9 occurs
    assert rows == arithmetic_rows(500, seed=1)
    assert rows != arithmetic_rows(500, seed=2)
    assert rows[0] == {"prompt": rows[0]["prompt"], "label": rows[0]["label"]}  # exactly prompt/label


def test_subtraction_never_negative_and_limits_respected():
    rows = arithmetic_rows(400, seed=0, max_operand=20, ops=("+", "-"), max_answer=15)
    answers = [solve(r["prompt"]) for r in rows]
    assert min(answers) >= 0 and max(answers) <= 15
    assert any("-" in r["prompt"] for r in rows) and any("+" in r["prompt"] for r in rows)
    assert max(int(x) for r in rows for x in r["prompt"][:-1].replace("-", "+").split("+")) > 9


def test_bad_parameters():
    with pytest.raises(ValueError, match="ops must be"):
        arithmetic_rows(3, ops=("*",))
    with pytest.raises(ValueError, match="num_examples"):
        arithmetic_rows(0)


def test_written_file_goes_through_prompt_dataset(tmp_path):
    path = write_arithmetic_jsonl(tmp_path / "q" / "train.jsonl", 64, seed=5)
    lines = path.read_text().splitlines()
    assert [json.loads(ln) for ln in lines] == arithmetic_rows(64, seed=5)
    ds = PromptDataset(
        DatasetConfig(
            str(path), batch_size=8, shuffle=False, apply_chat_template=False, max_prompt_length=None
        )
    )
    first = ds.next_batch()[0]
    assert (first.prompt_text, first.label) == (json.loads(lines[0])["prompt"], json.loads(lines[0])["label"])
