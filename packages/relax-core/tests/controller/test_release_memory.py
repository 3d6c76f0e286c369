"""``rollout.release_memory``: in colocate mode the engines free their accelerator memory after the rollout
and take it back before the weight sync (the trainer gets the device to itself while it trains)."""

from __future__ import annotations

import json
from contextlib import suppress
from types import SimpleNamespace

import pytest

from relax.core.config import ConfigError, load_config
from relax.core.controller import capabilities, stages

SMALL = [
    "total_steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "data.task_size=100",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.save_every=0",
]


def test_it_is_a_colocate_option_that_needs_the_engines_methods():
    with pytest.raises(ConfigError, match=r"rollout.release_memory: supported in mode 'colocate' only"):
        load_config(None, ["rollout.release_memory=true", "mode=async", "max_staleness=1"])
    need = capabilities.required(load_config(None, ["rollout.release_memory=true"]))["rollout"]
    assert need == {"release_memory": "rollout.release_memory", "resume_memory": "rollout.release_memory"}
    with pytest.raises(capabilities.CapabilityError, match=r"does not implement release_memory\(\)"):
        capabilities.check(
            load_config(None, ["rollout.release_memory=true"]), {"rollout": ("plain", ["abort"])}
        )


class RecordingFleet:
    """Stand-in for the fleet's control calls (records them; engine 1 dies while released)."""

    def __init__(self):
        self.calls, self.engines = [], {0: "e0", 1: "e1"}
        self.router = SimpleNamespace(live=lambda: dict(self.engines))

    def control(self, method, engines=None):
        self.calls.append((method, sorted(self.engines if engines is None else engines)))
        return dict.fromkeys(self.engines if engines is None else engines)


def test_engines_get_their_memory_back_after_the_block_even_when_it_fails():
    cfg, fleet, metrics = load_config(None, ["rollout.release_memory=true"]), RecordingFleet(), {}
    with suppress(RuntimeError), stages.engine_memory_released(fleet, cfg, metrics):
        assert fleet.calls == [("release_memory", [0, 1])]
        del fleet.engines[1]  # evicted meanwhile: not asked to resume
        raise RuntimeError("the training failed")
    assert fleet.calls == [("release_memory", [0, 1]), ("resume_memory", [0])]
    assert {"time/release_memory_s", "time/resume_memory_s"} <= set(metrics)
    off = RecordingFleet()
    with stages.engine_memory_released(off, load_config(None), {}):
        pass
    assert off.calls == []


@pytest.mark.timeout(600)
def test_a_run_with_a_separate_engine_releases_and_resumes_every_step(tmp_path):
    """Real Ray, the HF engine in its own actor, the trainer offloaded between updates (``trainer.offload``,
    ``controller.handoff``): every step times the engines' two calls and the trainer's onload / offload and logs
    the trainer's memory at each phase, and the engine that took its memory back and was synced from a trainer
    that went to the host and back serves exactly the trainer's weights (step 2's rollout/train mismatch)."""
    from relax.core.controller.run import run

    run(
        load_config(
            None,
            [
                *SMALL,
                "rollout.host=separate",
                "rollout.release_memory=true",
                "trainer.offload=true",
                f"run_dir={tmp_path}",
            ],
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    timed = {"time/release_memory_s", "time/resume_memory_s", "time/onload_s", "time/offload_s"}
    memory = {f"perf/rss_{p}_gb" for p in ("before_rollout", "before_train", "after_update", "after_offload")}
    assert len(rows) == 2 and all(timed | memory <= set(r) for r in rows)
    assert rows[1]["policy_version"] == 2 and rows[1]["rollout/train_logprob_abs_diff"] < 1e-5
