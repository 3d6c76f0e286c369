"""The quick-start on the megatron trainer at TP=2 x PP=2 (four rank actors over gloo, 1F1B) through
``relax run``: it trains, and after the last weight sync the engine serves exactly the gathered trainer
weights (core's collective export: every rank gathers, rank 0 sends)."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_megatron.yaml"


def _collect(run_handle, status, out):
    """In the driver before teardown: what the engine serves and what the trainer exports now.
    (Reaches the run's roles through the handle's private state: test-only inspection.)"""
    state = run_handle._state
    (engine,) = state.fleet.live().values()
    out["status"] = status
    out["peers"] = len(state.roles.trainer_peers)
    out["served"] = ray.get(engine.call.remote("state_dict"), timeout=120)
    stream = state.roles.trainer.export_weights.options(num_returns="streaming").remote(1 << 20)
    out["exported"] = {n: t for ref in stream for n, t in ray.get(ref, timeout=120)}


@pytest.fixture
def observer(monkeypatch):
    from relax.core import plugins

    out: dict = {}
    module = types.ModuleType("megatron_run_observer")
    module.relax_on_run_end = lambda run, status: _collect(run, status, out)
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"observer": module}))
    return out


def test_quickstart_trains_and_syncs_the_gathered_weights(ray_session, tmp_path, observer):
    """TP=2 x PP=2 (four rank actors) in one run: it covers what TP=2 and PP=2 runs each would, in the time of one."""
    run_dir = tmp_path / "megatron"
    tp, pp = 2, 2
    cfg = load_config(
        EXAMPLE,
        [
            f"trainer.backend_params.tensor_parallel={tp}",
            f"trainer.backend_params.pipeline_parallel={pp}",
            "total_steps=2",
            f"run_dir={run_dir}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "trainer.micro_batch_size=8",
            "data.task_size=200",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    assert cfg.trainer.backend == "megatron" and cfg.trainer.backend_params.pipeline_parallel == 2
    summary = run(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
    assert observer["status"] == "completed" and observer["peers"] == tp * pp - 1  # rank 0 leads the others
    trainer_ckpt = run_dir / "checkpoints" / "step_000002" / "trainer"  # both ranks wrote a dist checkpoint
    assert (trainer_ckpt / "metadata.json").is_file() and (trainer_ckpt / "hf" / "config.json").is_file()
    served, exported = observer["served"], observer["exported"]
    assert set(served) - set(exported) == {"lm_head.weight"}  # tied to the embedding: exported once
    assert torch.equal(served["lm_head.weight"], exported["model.embed_tokens.weight"])
    for name, tensor in exported.items():
        assert torch.equal(served[name], tensor), name
    from relax.core.controller.runtime import resolve_model_path
    from relax.core.testing.models import load_hf_weights

    initial = load_hf_weights(resolve_model_path(cfg))
    assert any(
        not torch.equal(initial[n], t) for n, t in exported.items() if n in initial
    )  # training moved them
