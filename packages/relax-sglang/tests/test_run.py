"""A short async ``relax run`` through Ray whose rollout engine ATTACHES to the session's SGLang server by
URL (no launch of its own): rewards are recorded, the trainer's weight versions reach the server, and the
sampled tokens carry the versions the server reported (staleness within the bound, never negative)."""

from __future__ import annotations

import json

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.sglang.testing import load_weights

STEPS = 3


def test_async_run_attached_to_the_shared_server(ray_session, sglang_engine, tiny_dirs, tmp_path):
    engine, run_dir = sglang_engine, tmp_path / "run"
    load_weights(engine, tiny_dirs[0], 0)  # the run starts at version 0: so must the server
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={tiny_dirs[0]}", f"total_steps={STEPS}", "mode=async", "max_staleness=1",
        "rollout.engine=sglang", f"rollout.engine_params.urls=[{engine.url}]", "weight_sync.transport=sglang_tensor",
        "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=3",
        "trainer.micro_batch_size=16", "data.task_size=64", "logging.progress=false", "logging.console=false",
        "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_every=0",
        "checkpoint.save_hf_final=false", "checkpoint.resume=never",
    ])  # fmt: skip
    try:
        run(cfg)
        served = engine.client.get("/model_info")["weight_version"]
    finally:
        load_weights(engine, tiny_dirs[0], engine.weight_version() + STEPS + 1)  # later tests see the original
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0 for r in rows), rows
    assert all(r["policy_version"] == r["step"] for r in rows)
    assert int(served) == STEPS, f"the server serves weight version {served} after {STEPS} synced steps"
    # tokens carry the server's versions: one step ahead at most, never from the future
    assert all(0 <= r["staleness/mean"] <= r["staleness/max"] <= 1 for r in rows), [r["staleness/max"] for r in rows]
    assert max(r["staleness/max"] for r in rows) == 1, "no sample came from an older version: versions not recorded"
