"""The quick-start on the megatron trainer at TP=2 x PP=2 (four rank actors over gloo, 1F1B) through
``relax run``: it trains, and after the last weight sync the engine serves exactly the gathered trainer
weights (core's collective export: every rank gathers, rank 0 sends). The same on the model families that reach
megatron through relax-models' adapters (GLM-4-MoE, DeepSeek-V3), with MoE routing replay on."""

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
    out["version"] = ray.get(engine.call.remote("weight_version"), timeout=120)
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


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """model type -> a tiny GLM-4-MoE / DeepSeek-V3 with the quick-start tokenizer (relax-models' builder)."""
    from relax.core.quickstart_model import build_tokenizer
    from relax.models.tiny import CONFIGS, tiny_family_dir

    root = tmp_path_factory.mktemp("families")
    return {t: tiny_family_dir(root / t, t, build_tokenizer()) for t in CONFIGS}


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_a_family_trains_on_megatron_with_routing_replay(
    ray_session, tmp_path, observer, family_dirs, model_type
):
    """The quick-start with the family's tiny model on one megatron rank, ``algorithm.routing_replay: rollout``:
    two steps train (finite loss, the weights move), the HF engine's recorded routing replays with the trainer's
    routers agreeing (same weights), and the engine serves the trainer's weights at version 2.
    That these steps learn as the torch trainer's do rests on test_families.py (one megatron step = the torch
    trainer's, TP=1 and TP=2 x EP=2) and the torch quick-start's learning test; a reward-learning run of its own
    would take minutes per family."""
    run_dir = tmp_path / model_type
    cfg = load_config(
        EXAMPLE,
        [
            f"model.path={family_dirs[model_type]}",
            "trainer.backend_params.tensor_parallel=1",
            "algorithm.routing_replay=rollout",
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
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    assert run(cfg)["steps"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)
    for r in rows:  # the engine and the trainer hold the same weights when the rollout runs (max_staleness 0)
        assert r["train/routing/mismatch_frac_replay"] < 0.01, r  # only a near-tie could flip (fp32 sums)
        assert r["train/routing/logprob_diff_replay"] < 1e-5, (
            r
        )  # replayed: the rollout's experts, its logprobs
    assert observer["status"] == "completed" and observer["version"] == 2
    served, exported = observer["served"], _fused(observer["exported"])
    assert sorted(served) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(served[name], tensor), name
    from relax.core.testing.models import load_hf_weights

    initial = _fused(load_hf_weights(family_dirs[model_type]))
    assert any(not torch.equal(initial[n], t) for n, t in exported.items() if n in initial)


def _fused(weights: dict) -> dict:
    """Per-expert HF names (the trainer's export, the checkpoint's) as the HF engine's model holds them: each
    layer's experts fused into ``gate_up_proj`` / ``down_proj``."""
    out = dict(weights)
    for down in [n for n in out if n.endswith(".mlp.experts.0.down_proj.weight")]:
        layer = down[: -len("0.down_proj.weight")]
        experts = range(sum(1 for n in out if n.startswith(layer) and n.endswith(".down_proj.weight")))
        out[layer + "gate_up_proj"] = torch.stack(
            [
                torch.cat([out.pop(f"{layer}{j}.gate_proj.weight"), out.pop(f"{layer}{j}.up_proj.weight")])
                for j in experts
            ]
        )
        out[layer + "down_proj"] = torch.stack([out.pop(f"{layer}{j}.down_proj.weight") for j in experts])
    return out
