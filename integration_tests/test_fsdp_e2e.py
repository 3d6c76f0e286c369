"""``trainer.backend: fsdp`` through ``relax run``'s code path, selected by configuration only: the
quick-start with two sharded rank actors learns (5-step mean reward from under 0.25 to 0.5 or more) and ends with a loadable HF
model (weights synced by shared memory), and the omni VL quick-start (a tiny Qwen2.5-VL, image and video
rows) runs end to end with the broadcast transport."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.omni.tiny_models import tiny_multimodal_dir

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUIET = [
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
    "checkpoint.resume=never",
]
FSDP2 = ["trainer.backend=fsdp", "trainer.backend_params.world_size=2", "trainer.backend_params.num_cpus=0.5"]


def rewards(run_dir: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_quickstart_with_fsdp_world_2_learns(ray_session, tmp_path):
    """45 steps: the 5-step mean reward rises from under 0.25 to at least 0.5. The trajectory is chaotic across
    CPUs (same seed: 0.8 by step 36 on one machine, 0.68 at best in 45 on CI's), so the bar is learning, not
    the quick-start's 0.8; equality with the torch trainer is tests/trainers/fsdp's job (1e-5 per step)."""
    cfg = load_config(
        str(EXAMPLES / "quickstart.yaml"),
        [*FSDP2, "total_steps=45", f"run_dir={tmp_path}", *QUIET, "checkpoint.save_hf_final=true"],
    )
    assert cfg.trainer.backend == "fsdp" and type(cfg.trainer.backend_params).__name__ == "FSDPParams"
    run(cfg)
    got = rewards(tmp_path)
    means = [sum(got[i - 5 : i]) / 5 for i in range(5, len(got) + 1)]
    assert len(got) == 45 and means[0] < 0.25 and max(means) >= 0.5, means
    from transformers import AutoModelForCausalLM

    final = next(p for p in tmp_path.rglob("config.json") if (p.parent / "model.safetensors").exists()).parent
    model = AutoModelForCausalLM.from_pretrained(final)  # a plain HF model, gathered from the shards
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_the_omni_vl_quickstart_runs_with_fsdp(ray_session, tmp_path_factory, tmp_path):
    spec = importlib.util.spec_from_file_location("omni_prepare", EXAMPLES / "omni" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    from relax.omni.synthetic import make_dataset

    data = make_dataset(tmp_path_factory.mktemp("vl") / "vl", prepare.TASKS["vl"][1], rows=8)
    model = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")
    cfg = load_config(
        str(EXAMPLES / "quickstart_omni_vl.yaml"),
        [
            f"model.path={model}",
            f"data.path={data}",
            f"data.processor_params.media_root={data.parent}",
            *FSDP2,
            "total_steps=2",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "trainer.micro_batch_size=2",
            "algorithm.entropy_coef=0.03",  # a gradient even when a group's rewards tie (the file trains without)
            "weight_sync.transport=broadcast",  # its own gloo group in rank 0, beside the ranks' default group
            f"run_dir={tmp_path}",
            *QUIET,
            "checkpoint.save_hf_final=false",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
