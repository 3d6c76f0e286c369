"""VL eval on the omni VL quick-start (examples/quickstart_omni_vl.yaml): a held-out set of image prompts is
processed with the run's processor (media loaded per evaluation) and scored on the engines like the text sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_vl_eval_scores_image_prompts(tmp_path):
    from relax.omni.quickstart import QUICKSTARTS
    from relax.omni.synthetic import make_dataset
    from relax.omni.tiny_models import tiny_multimodal_dir

    tasks = QUICKSTARTS["omni_vl_quickstart"].tasks
    data = make_dataset(tmp_path / "task", tasks, rows=8)
    held = make_dataset(
        tmp_path / "task", tasks, rows=6, seed=1, name="held.jsonl"
    )  # same media root, other rows
    cfg = load_config(
        EXAMPLES / "quickstart_omni_vl.yaml",
        [
            f"model.path={tiny_multimodal_dir(tmp_path, 'qwen2_5_vl')}",
            f"data.path={data}",
            f"data.processor_params.media_root={data.parent}",
            f"run_dir={tmp_path / 'run'}",
            "total_steps=1",
            "rollout.prompts_per_step=4",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.save_every=0",
            f"eval.sets.vl.path={held}",
            "eval.sets.vl.source_key=task",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["eval/vl/failed"] == 0 and r["eval/vl/prompts"] == 6 and 0 <= r["eval/vl/accuracy"] <= 1
    completions = [
        json.loads(line)
        for line in (tmp_path / "run" / "eval" / "vl" / "step_1.jsonl").read_text().splitlines()
    ]
    assert len(completions) == 6
    assert all("<|image_pad|>" in c["prompt"] or "<|vision_start|>" in c["prompt"] for c in completions)
