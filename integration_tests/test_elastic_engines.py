"""The run handle's control object, driven by a plugin's lifecycle hooks during a real async run:
an engine added between steps serves the current weight version, the original engine is removed
(and its reservation reused by the next added engine), and every prompt group is trained exactly
once with all of its samples (ids end to end)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

PLUGIN = """
RECORD = {"groups": []}

def relax_on_run_start(run):
    RECORD["run"] = run
    RECORD["start_engines"] = run.engine_indices

def relax_on_step_end(step, metrics):
    control = RECORD["run"].control
    if step == 1:
        RECORD["added"] = control.add_engine()
    if step == 3:
        RECORD["engines_before_remove"] = RECORD["run"].engine_indices
        RECORD["removed"] = control.remove_engine(0)
    if step == 4:
        RECORD["readded"] = control.add_engine()  # runs on engine 0's freed reservation

def relax_filter_group(group):
    RECORD["groups"].append([(s.group_id, s.index_in_group) for s in group])
    return True

def relax_on_run_end(run, status):
    RECORD.update(status=status, health=run.engine_health(), version=run.weight_version)
"""

P, N, STEPS = 4, 4, 6


@pytest.fixture
def elastic_plugin(tmp_path, monkeypatch):
    (tmp_path / "elastic_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RELAX_PLUGINS", "elastic_plugin")  # the hooks run in the driver only
    get_plugin_manager(refresh=True)
    yield sys.modules["elastic_plugin"].RECORD
    monkeypatch.delenv("RELAX_PLUGINS")
    get_plugin_manager(refresh=True)
    sys.modules.pop("elastic_plugin", None)


def test_add_and_remove_engines_between_steps_of_an_async_run(ray_session, tmp_path, elastic_plugin):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"rollout.prompts_per_step={P}",
            f"rollout.n_samples_per_prompt={N}",
            "rollout.max_new_tokens=3",
            "trainer.micro_batch_size=16",
            "data.task_size=200",
            f"total_steps={STEPS}",
            f"run_dir={run_dir}",
            "mode=async",
            "max_staleness=1",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    summary = run(cfg)
    record = elastic_plugin
    assert summary["steps"] == STEPS and record["status"] == "completed"
    assert record["start_engines"] == [0]
    assert record["added"].result(timeout=0) == 1  # a new index, never reused
    assert record["engines_before_remove"] == [0, 1]
    assert record["removed"].result(timeout=0) is None
    assert record["readded"].result(timeout=0) == 2
    # the two added engines are left, both serving the final weights
    health = [(h["engine_index"], h["ok"], h["weight_version"]) for h in record["health"]]
    assert health == [(1, True, STEPS), (2, True, STEPS)]
    assert record["version"] == STEPS
    # every group trained exactly once, each with all of its samples
    groups = record["groups"]
    assert sorted(g[0][0] for g in groups) == list(range(P * STEPS))
    assert all(sorted(i for _, i in g) == list(range(N)) and len({gid for gid, _ in g}) == 1 for g in groups)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert rows[-1]["fault/engines_live"] == 2.0
