"""Eval metrics of scored groups: accuracy, pass@k, mean@k, maj@k, lengths, truncation, per source."""

from __future__ import annotations

import pytest

from relax.core.data import Sample
from relax.core.evaluation.report import completion_rows, set_metrics


def _group(
    gid: int, answers: list[str], label: str, source: str | None = None, truncated: int = 0
) -> list[Sample]:
    out = []
    for i, text in enumerate(answers):
        s = Sample(
            prompt_ids=[1],
            group_id=gid,
            index_in_group=i,
            prompt_text=f"p{gid}",
            label=label,
            metadata={"data_source": source} if source else {},
            response_ids=[5] * (len(text) + 1),
            response_text=text,
            versions=[3] * (len(text) + 1),
            finish_reason="length" if i < truncated else "stop",
        )
        s.reward = 1.0 if text == label else 0.0
        s.reward_info = {"score": s.reward}
        out.append(s)
    return out


def test_metrics_of_two_prompts_by_hand():
    groups = [
        _group(0, ["7", "3", "7", "1"], "7", "math", truncated=1),
        _group(1, ["2", "2", "2", "5"], "5", "gsm"),
    ]
    m = set_metrics(groups, "data_source")
    assert m["accuracy"] == pytest.approx(3 / 8)
    assert m["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert m["pass@2"] == pytest.approx(
        ((1 - 1 / 6) + (1 - 3 / 6)) / 2
    )  # 1 - C(2,2)/C(4,2), 1 - C(3,2)/C(4,2)
    assert m["pass@4"] == 1.0
    assert m["mean@4"] == pytest.approx(3 / 8)
    assert m["maj@4"] == pytest.approx(0.5)  # "7" wins prompt 0 (right), "2" wins prompt 1 (wrong)
    assert m["response/length_mean"] == pytest.approx(2.0) and m["response/length_max"] == 2.0
    assert m["response/truncated_frac"] == pytest.approx(1 / 8)
    # per source: each source's own numbers
    assert m["source/math/accuracy"] == pytest.approx(0.5) and m["source/math/maj@4"] == 1.0
    assert m["source/gsm/accuracy"] == pytest.approx(0.25) and m["source/gsm/maj@4"] == 0.0
    assert m["source/gsm/prompts"] == 1.0


def test_one_source_or_none_gives_no_breakdown_and_greedy_has_no_majority():
    m = set_metrics([_group(0, ["7"], "7", "math"), _group(1, ["1"], "2", "math")], "data_source")
    assert not any(k.startswith("source/") for k in m)
    assert "maj@1" not in m and "mean@1" not in m and m["pass@1"] == 0.5


def test_completion_rows_carry_score_answer_and_version():
    rows = completion_rows([_group(0, ["7", "x"], "7", "math")], step=4, version=3, source_key="data_source")
    got = [(r["response"], r["score"], r["answer"], r["source"]) for r in rows]
    assert got == [("7", 1.0, "7", "math"), ("x", 0.0, "x", "math")]
    assert {(r["step"], r["version"], r["min_version"]) for r in rows} == {(4, 3, 3)}
