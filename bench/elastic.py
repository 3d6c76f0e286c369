"""Elastic rollout through the control plane, in the simulated cluster of ``bench/async_overlap.py``
(real controller, queue, router, weight sync and REST API on Ray Serve; engines and trainer sleep).

One async run starts with 1 engine; after every ``segment`` steps an operator thread asks the API
for one more engine (``POST /engines/scale_out``) and times request -> operation ``active`` (engine
started, health-checked, synced to the current weights, routed to). Reports steps/s with 1, 2 and 3
engines in the same run as ratios to 1 engine; the headline is printed last.

    python bench/elastic.py [segment]      # default: 12 steps per engine count
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import sim_env  # noqa: F401  (first: points Ray workers at the sim plugin)

# isort: split

import ray
import requests

from relax.core.config import load_config
from relax.core.controller.ray_start import start_loopback_ray
from relax.core.controller.run import run
from relax.core.hookspecs import hookimpl
from relax.core.plugins import get_plugin_manager

MAX_ENGINES = 3
SIM = [
    "rollout.engine=sim",
    "trainer.backend=sim",
    "reward.name=sim",
    "rollout.num_engines=1",
    "rollout.engine_params.slots=8",
    "rollout.engine_params.token_s=0.0005",
    "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "trainer.recompute_old_logprobs=false",
    "mode=async",
    "max_staleness=1",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "data.task_size=4000",
    "control.enabled=true",
    "control.publish_s=0.2",
]
SKIP = 2  # steps after each change not counted (the new engine's first requests, the pipeline refilling)


class Operator:
    """Asks the control API for one more engine after every ``segment`` steps; times each request."""

    def __init__(self, base: str, segment: int) -> None:
        self.base, self.segment = base, segment
        self.latencies: list[float] = []
        self.threads: list[threading.Thread] = []

    @hookimpl
    def relax_on_step_end(self, step, metrics):
        if step % self.segment == 0 and step // self.segment < MAX_ENGINES:
            self.threads.append(threading.Thread(target=self._scale_out, daemon=True))
            self.threads[-1].start()

    def _scale_out(self) -> None:
        started = time.monotonic()
        op = requests.post(self.base + "/engines/scale_out", json={"num_engines": 1}, timeout=30).json()
        while op["state"] not in ("active", "failed", "cancelled"):
            time.sleep(0.02)
            op = requests.get(f"{self.base}/operations/{op['id']}", timeout=30).json()
        if op["state"] != "active":
            raise RuntimeError(f"scale-out did not complete: {op}")
        self.latencies.append(time.monotonic() - started)


def steps_per_s(rows: list[dict]) -> dict[int, float]:
    """Steps/s per engine count, each segment without its first SKIP steps."""
    by_engines: dict[int, list[float]] = {}
    for row in rows:
        by_engines.setdefault(int(row["fault/engines_live"]), []).append(row["timestamp"])
    out = {}
    for engines, stamps in by_engines.items():
        stamps = stamps[SKIP:]
        if len(stamps) >= 2:
            out[engines] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return out


def main(argv: list[str]) -> None:
    segment = int(argv[0]) if argv else 12
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_loopback_ray(
        num_cpus=2 * MAX_ENGINES + 2
    )  # 127.0.0.1 only, as `relax run` starts Ray; workers inherit the env
    operator = Operator(f"http://127.0.0.1:{port}", segment)
    get_plugin_manager().pm.register(operator, name="elastic-bench-operator")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "elastic"
        run(
            load_config(
                None,
                [*SIM, f"total_steps={segment * MAX_ENGINES}", f"run_dir={run_dir}", f"control.port={port}"],
            )
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ray.shutdown()
    rates = steps_per_s(rows)
    base = rates[1]
    print(f"{'engines':>8} {'steps/s':>8} {'vs 1 engine':>12}")
    for engines in sorted(rates):
        print(f"{engines:>8} {rates[engines]:>8.3f} {rates[engines] / base:>11.2f}x")
    print(
        f"scale-out request -> engine active with current weights: median {statistics.median(operator.latencies):.2f}s, "
        f"max {max(operator.latencies):.2f}s over {len(operator.latencies)} operations"
    )
    top = max(rates)
    print(
        f"elastic: {rates[top] / base:.2f}x steps/s with {top} engines vs 1 "
        f"({', '.join(f'{e}: {rates[e] / base:.2f}x' for e in sorted(rates) if e not in (1, top))})"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
