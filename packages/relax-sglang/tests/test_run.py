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
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_dirs[0]}",
            f"total_steps={STEPS}",
            "mode=async",
            "max_staleness=1",
            "rollout.engine=sglang",
            f"rollout.engine_params.urls=[{engine.url}]",
            "weight_sync.transport=sglang_tensor",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=3",
            "trainer.micro_batch_size=16",
            "data.task_size=64",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    try:
        run(cfg)
        served = engine.client.get("/model_info")["weight_version"]
    finally:
        load_weights(
            engine, tiny_dirs[0], engine.weight_version() + STEPS + 1
        )  # later tests see the original
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["response/length_mean"] > 0 for r in rows), rows
    assert all(r["policy_version"] == r["step"] for r in rows)
    assert int(served) == STEPS, f"the server serves weight version {served} after {STEPS} synced steps"
    # tokens carry the server's versions: one step ahead at most, never from the future
    assert all(0 <= r["staleness/mean"] <= r["staleness/max"] <= 1 for r in rows), [
        r["staleness/max"] for r in rows
    ]
    assert max(r["staleness/max"] for r in rows) == 1, (
        "no sample came from an older version: versions not recorded"
    )


def test_scale_out_by_url_attaches_a_synced_engine(ray_session, sglang_engine, tiny_dirs, tmp_path):
    """Core's scale-out by URL against the session's server: ``EngineFleet.attach_engines([url])`` starts a
    real ``sglang`` engine actor attached there (no launch), brings it to the run's weight version (here:
    the other model's weights) before it serves, then it serves exactly those weights."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from relax.core.controller import runtime
    from relax.core.controller.faults import FaultCounters
    from relax.core.controller.fleet import EngineFleet, with_engine_params
    from relax.core.protocols import GenerationRequest, SamplingParams
    from relax.core.testing.models import load_hf_weights

    engine = sglang_engine
    version = engine.weight_version() + 1
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            f"model.path={tiny_dirs[0]}",
            "rollout.engine=sglang",
            f"rollout.engine_params.python={engine.params.python}",
            "rollout.control_timeout_s=120",
        ],
    )
    phases: list[str] = []

    def start_engine(index, slot, engine_params=None):  # as RunState._start_engine does
        return runtime.start_engine(with_engine_params(cfg, engine_params), tiny_dirs[0], index, None, slot)

    class OneBucketSync:  # the run's WeightSync, reduced to one tensor bucket of the new weights
        def sync(self, trainer, handles, version):
            weights = list(load_hf_weights(tiny_dirs[1]).items())
            for h in handles:
                ray.get(h.call.remote("begin_weight_update", version), timeout=120)
                ray.get(h.update_weights.remote(weights, version), timeout=120)
                ray.get(h.call.remote("end_weight_update", version), timeout=120)
            return {}

        def check_engine(self, engine):
            pass

        def close(self):
            pass

    fleet = EngineFleet(cfg, [], start_engine, OneBucketSync(), None, FaultCounters(), version=version)
    try:
        (index,) = fleet.attach_engines([engine.url], on_phase=lambda phase, _: phases.append(phase))
        handle = fleet.live()[index]
        assert phases[-2:] == ["weight-syncing", "active"], phases
        health = ray.get(handle.health.remote(), timeout=60)
        assert health["url"] == engine.url and health["weight_version"] == version, health
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        (res,) = ray.get(handle.generate.remote([GenerationRequest("s", [4, 5, 6], params)]), timeout=120)
    finally:
        fleet.close()
        for started in fleet.live().values():
            ray.kill(started)  # the actor only (an attached engine never stops its server)
        load_weights(engine, tiny_dirs[0], version + 1)  # later tests see the original weights
    other = AutoModelForCausalLM.from_pretrained(tiny_dirs[1], dtype=torch.float32).eval()
    with torch.no_grad():
        out = other.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert res.response_ids == out[0, 3:].tolist() and res.versions == [version] * 6, (
        res.response_ids,
        res.versions,
    )
