"""Agentic eval on the tool quick-start (examples/quickstart_agent.yaml): an eval set runs whole episodes with
the run's environment and reports turns and tool calls beside its accuracy; its trajectories are on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(1200)  # a cold cache builds the warmed-up agent model first (4 minutes on 2 busy cores)
def test_agentic_eval_reports_turns_and_tool_calls(tmp_path):
    from relax.agents.quickstart import ensure_agent_model, ensure_task_data

    train = ensure_task_data(tmp_path / "train.jsonl", n=64)
    held = ensure_task_data(tmp_path / "held.jsonl", n=16, seed=1)
    cfg = load_config(
        EXAMPLES / "quickstart_agent.yaml",
        [
            f"model.path={ensure_agent_model()}",
            f"data.path={train}",
            f"run_dir={tmp_path / 'run'}",
            "total_steps=1",
            "rollout.prompts_per_step=4",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            f"eval.sets.tools.path={held}",
            "eval.sets.tools.max_prompts=8",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["eval/tools/prompts"] == 8 and r["eval/tools/failed"] == 0
        assert 1 <= r["eval/tools/turns_mean"] <= 3  # quickstart_agent: max_turns 3
        assert 0 <= r["eval/tools/tool_calls_mean"] <= r["eval/tools/turns_mean"]
    episodes = [
        json.loads(line)
        for line in (tmp_path / "run" / "eval" / "tools" / "step_1.jsonl").read_text().splitlines()
    ]
    assert len(episodes) == 8 and all(e["episode"]["turns"] >= 1 for e in episodes)
    assert sum(e["episode"]["tool_calls"] for e in episodes) / 8 == rows[1]["eval/tools/tool_calls_mean"]
