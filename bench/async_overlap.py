"""Async/hybrid vs colocate throughput on a simulated cluster (real controller, sleeping compute).

Engines (continuous batching, long-tailed log-normal response lengths) and the trainer are Ray
actors from ``bench/sim_plugin.py``; everything else -- transfer queue, router, staleness gate,
partial rollout, weight sync -- is the real Relax code. Prints steps/s of each mode and staleness
relative to colocate, plus the trainer's idle fraction and where a step's time goes (the trainer's
wait for rows, its update, the weight publish, the rest of the driver's serial work), next to the
ceiling a driver that costs nothing would reach on the same model (``plugins/sim_bound.py``): at
staleness 1-2 the trainer must still wait for a step's longest responses, which the gate does not let
start earlier.

    python bench/async_overlap.py [steps]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import sim_env  # noqa: F401  (first: points Ray workers at the sim plugin)

# isort: split

from sim_bound import ideal_ratio

from relax.core.config import load_config
from relax.core.controller.ray_start import start_loopback_ray
from relax.core.controller.run import run

SIM = [
    "rollout.engine=sim",
    "trainer.backend=sim",
    "reward.name=sim",
    "rollout.num_engines=2",
    "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "trainer.recompute_old_logprobs=false",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "data.task_size=4000",
]
WARMUP = 2
ENGINES, SLOTS, ROWS = 2, 32, 16 * 8  # as SIM sets them (SLOTS: SimEngineParams' default)


def measure(mode: str, staleness: int, steps: int, root: Path) -> tuple[float, float, str]:
    run_dir = root / f"{mode}-{staleness}"
    every = 1
    run(
        load_config(
            None,
            [
                *SIM,
                f"mode={mode}",
                f"max_staleness={staleness}",
                f"total_steps={steps}",
                f"run_dir={run_dir}",
                f"weight_sync.every_n_steps={every}",
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP:]
    seconds = timed[-1]["timestamp"] - rows[WARMUP - 1]["timestamp"]
    idle = sum(r.get("perf/trainer_idle_frac", 0.0) for r in timed) / len(timed)
    return len(timed) / seconds, idle, breakdown(timed)


def breakdown(rows: list[dict]) -> str:
    """Mean seconds per step: waiting for rows, training, publishing weights, everything else."""

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / len(rows)

    parts = {"wait": mean("time/trainer_wait_s"), "train": mean("time/train_s"), "sync": mean("time/sync_s")}
    other = mean("time/step_s") - sum(parts.values())
    return " ".join(f"{k} {v:.3f}" for k, v in {**parts, "other": other}.items())


def main(argv: list[str]) -> None:
    import ray

    steps = int(argv[0]) if argv else 12
    start_loopback_ray(num_cpus=4)  # 127.0.0.1 only, as `relax run` starts Ray; workers inherit the env
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, _, _ = measure("colocate", 0, steps, root)
        print(
            f"{'mode':<9} {'staleness':>9} {'steps/s':>8} {'vs colocate':>12} {'ceiling':>8} {'trainer idle':>13}  s/step: wait train sync other"
        )
        print(f"{'colocate':<9} {0:>9} {base:>8.3f} {1.0:>11.2f}x {1.0:>7.2f}x {'-':>13}")
        best = {}
        for mode, staleness in [
            ("async", 0),
            ("async", 1),
            ("async", 2),
            ("async", 4),
            ("hybrid", 1),
            ("hybrid", 2),
            ("hybrid", 4),
        ]:
            rate, idle, parts = measure(mode, staleness, steps, root)
            ceiling = ideal_ratio(staleness, ROWS, ENGINES * SLOTS)
            print(
                f"{mode:<9} {staleness:>9} {rate:>8.3f} {rate / base:>11.2f}x {ceiling:>7.2f}x {idle:>12.1%}  {parts}",
                flush=True,
            )
            if staleness >= 1:
                best[(mode, staleness)] = (rate / base, idle)
    ray.shutdown()
    (mode, staleness), (ratio, idle) = max(best.items(), key=lambda kv: kv[1][0])
    print(
        f"async_overlap: {ratio:.2f}x {mode} (max_staleness={staleness}, trainer idle {idle:.1%}) vs colocate throughput"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
