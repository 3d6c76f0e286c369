"""A reward that hangs and fails, a judge reached through ``ctx.engine_handle()``, and a data file
with a bad byte, through ``relax run`` in async mode (real Ray, real tiny model, own process).

The run must finish in bounded time, and its step metrics must carry what happened: the reward's
timeouts and failures (counted in async mode as in colocate), its extra components, the fallback
score, and the data counts of the first step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

PLUGIN = '''
import threading
from dataclasses import dataclass

import ray

from relax.core.hookspecs import hookimpl
from relax.core.protocols import GenerationRequest, SamplingParams

NEVER = threading.Event()


@dataclass(frozen=True)
class ProbeParams:
    use_judge: bool = True


class Probe:
    """Per step (groups 4k..4k+3), group 4k: sample 0 hangs forever in a plain def, sample 1 raises.
    Every other sample asks the judge engine for one token and reports it as a component."""

    def __init__(self, params, ctx):
        self.judge = ctx.engine_handle() if params.use_judge else None

    def score(self, sample):
        if sample.group_id % 4 == 0 and sample.index_in_group == 0:
            NEVER.wait()
        if sample.group_id % 4 == 0 and sample.index_in_group == 1:
            raise RuntimeError("probe failure")
        request = GenerationRequest(f"judge-{sample.group_id}-{sample.index_in_group}", list(sample.prompt_ids),
                                    SamplingParams(max_new_tokens=1, seed=0, ignore_eos=True))
        [result] = ray.get(self.judge.generate.remote([request]), timeout=60)
        return {"score": float(str(sample.label) in sample.response_text), "judge_tokens": float(len(result.response_ids))}


@hookimpl
def relax_register_rewards(register):
    register("probe", Probe, config=ProbeParams)
'''


def test_hanging_reward_judge_and_bad_data_in_async_mode(tmp_path):
    (tmp_path / "probe_plugin.py").write_text(PLUGIN)
    data = tmp_path / "train.jsonl"
    rows = [
        json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}).encode() for a in range(5) for b in range(5)
    ]
    rows.insert(3, b'{"prompt": "caf\xe9", "label": "1"}')
    data.write_bytes(b"\n".join(rows) + b"\n")
    run_dir = tmp_path / "run"
    args = [
        "mode=async",
        "max_staleness=1",
        "total_steps=2",
        f"run_dir={run_dir}",
        f"data.path={data}",
        "data.on_error=skip",
        "data.apply_chat_template=false",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=3",
        "trainer.micro_batch_size=16",
        "reward.name=probe",
        "reward.timeout_s=2",
        "reward.on_error=zero",
        "reward.fallback_score=-1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "logging.console=false",
        "checkpoint.save_hf_final=false",
        "checkpoint.resume=never",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "RELAX_PLUGINS": "probe_plugin",
        "RAY_ADDRESS": "",
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "relax.core.cli", "run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "25 prompts loaded, 1 malformed rows skipped" in proc.stderr
    assert f"{data}: row 4: byte offset" in proc.stderr and "invalid UTF-8 (byte 0xe9" in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (rows[0]["data/loaded"], rows[0]["data/skipped_malformed"], rows[0]["data/filtered_too_long"]) == (
        25,
        1,
        0,
    )
    assert "data/loaded" not in rows[1]
    for r in rows:  # one group 4k per step: one hung sample, one failing sample
        assert (r["reward/timeouts"], r["reward/failures"]) == (1.0, 2.0), r
        assert r["reward/judge_tokens_mean"] == 1.0
        assert r["reward/mean"] <= (14 * 1.0 + 2 * -1.0) / 16
    assert elapsed < 600  # the hung calls did not hold the run (each is abandoned after 2 s)
