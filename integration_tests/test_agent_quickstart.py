"""The agent quick-start learns to use its tool: a short run of examples/quickstart_agent.yaml.

At the start the warmed-up model calls the calculator in a minority of episodes and answers the
rest with a number it cannot know (reward ~0 without the tool); after a few GRPO steps it calls the
tool in most episodes and the reward follows. Each step has 64 episodes (a rate's standard error
<= 0.0625), each window two steps: the difference of two windows has a standard error <= 0.0625,
so a rise of 0.3 is more than 4.5 of them -- it cannot happen by chance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHORT = ["rollout.prompts_per_step=8"]  # 8 prompts x 8 episodes per step
QUIET = [
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
    "checkpoint.save_hf_final=false",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The warmed-up model (cached by recipe in $RELAX_CACHE_DIR) and the task data."""
    from relax.agents.quickstart import ensure_agent_model, ensure_task_data

    data = ensure_task_data(tmp_path_factory.mktemp("agent-data") / "train.jsonl", n=512)
    return [f"model.path={ensure_agent_model()}", f"data.path={data}"]


def _curves(run_dir: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows], [r["episode/tool_calls_mean"] for r in rows]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _assert_learns(run_dir: Path, steps: int, reward_rise: float, call_rise: float, window: int = 2) -> None:
    rewards, calls = _curves(run_dir)
    assert len(rewards) == steps
    assert rewards[0] <= 0.35 and calls[0] <= 0.4, (
        rewards[:3],
        calls[:3],
    )  # tool use is rare at the start ...
    # only episodes that called the tool can be right: the reward never exceeds the call rate
    assert all(r <= c + 1e-9 for r, c in zip(rewards, calls, strict=True)), (rewards, calls)
    first, last = slice(0, window), slice(steps - window, steps)
    assert _mean(calls[last]) - _mean(calls[first]) >= call_rise, calls  # ... and becomes the habit
    assert _mean(rewards[last]) - _mean(rewards[first]) >= reward_rise, rewards  # ... which is what pays


def test_the_agent_quickstart_learns_to_call_the_calculator(tmp_path, prepared):
    steps = 8
    cfg = load_config(
        str(EXAMPLES / "quickstart_agent.yaml"),
        [*prepared, *SHORT, f"total_steps={steps}", f"run_dir={tmp_path}", *QUIET],
    )
    run(cfg)
    _assert_learns(tmp_path, steps, reward_rise=0.3, call_rise=0.3)


def test_the_async_agent_quickstart_learns_too(tmp_path, prepared, ray_session):
    steps = 6
    cfg = load_config(
        str(EXAMPLES / "quickstart_agent_async.yaml"),
        [*prepared, *SHORT, f"total_steps={steps}", f"run_dir={tmp_path}", *QUIET],
    )
    assert cfg.mode == "async" and cfg.max_staleness == 1
    run(cfg)
    _assert_learns(tmp_path, steps, reward_rise=0.2, call_rise=0.2)
