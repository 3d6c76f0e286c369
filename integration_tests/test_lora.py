"""LoRA end to end (``trainer.lora``, docs/lora.md): the LoRA quick-start learns in the driver, and a
separate engine served through a real transport gets adapter-only syncs whose bytes are the adapter's,
samples with exactly the trainer's policy, and the KL reference is the trainer's own base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.hosting import in_driver
from relax.core.controller.run import run

pytestmark = pytest.mark.slow
# the full quick-start's target and window (test_quickstart_learns.py) at lr 2e-3, first reached at step 63
# (seed 0) and 40 (seeds 1, 2); lr 5e-3 collapses onto one answer, 1e-3 needs 75 (measured 2026-12-02).
# The full model needs 36-38. One seed here: CI time.
STEPS, TARGET, WINDOW = 80, 0.8, 5
EXAMPLE = Path(__file__).parents[1] / "examples" / "quickstart_lora.yaml"
QUIET = [
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_lora_quickstart_reaches_reward_0_8(tmp_path):
    cfg = load_config(
        EXAMPLE,
        [*QUIET, "seed=0", f"total_steps={STEPS}", f"run_dir={tmp_path}", "checkpoint.save_hf_final=false"],
    )
    assert in_driver(cfg) and cfg.trainer.lora is not None
    run(cfg)
    rewards = [r["reward/mean"] for r in _metrics(tmp_path)]
    means = [sum(rewards[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(rewards) + 1)]
    assert len(rewards) == STEPS and means[0] < 0.5, means[:3]
    assert max(means) >= TARGET, f"best {WINDOW}-step mean {max(means):.3f} in {STEPS} steps"


def test_separate_engine_gets_adapter_only_syncs_and_samples_the_trainers_policy(ray_session, tmp_path):
    from relax.core.quickstart_model import ensure_quickstart_model
    from relax.core.trainers.lora import adapter_bytes
    from relax.core.trainers.torch_trainer import trainer_from_config

    cfg = load_config(
        EXAMPLE,
        [
            *QUIET,
            "total_steps=3",
            f"run_dir={tmp_path}",
            "rollout.host=separate",
            "rollout.prompts_per_step=8",
            "algorithm.kl.coef=0.01",
            "checkpoint.save_hf_final=true",
        ],
    )
    summary = run(cfg)
    rows = _metrics(tmp_path)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    adapter = trainer_from_config(cfg, cfg.model.path or ensure_quickstart_model())
    expected = adapter_bytes(adapter.model, adapter.compute_dtype)
    full = sum(t.numel() * t.element_size() for t in adapter.model.get_base_model().state_dict().values())
    assert all(r["weight_sync/bytes"] == expected for r in rows), [r["weight_sync/bytes"] for r in rows]
    assert expected < full / 4
    # the engine samples what the trainer scores: adapter merged exactly (float noise), every step
    assert all(r["rollout/train_logprob_abs_diff"] < 1e-4 for r in rows), [
        r["rollout/train_logprob_abs_diff"] for r in rows
    ]
    # the KL reference (the trainer's base, adapters disabled) drifts from the policy as the adapter trains
    kl = [next(v for k, v in r.items() if k.endswith("kl_loss")) for r in rows]
    assert 0 < kl[-1] < 1, kl
    final = Path(summary["final_hf"])
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
