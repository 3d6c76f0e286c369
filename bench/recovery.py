"""Throughput while rollout engines keep dying: the simulated cluster of ``bench/async_overlap.py``
(real controller, queue, router, weight sync; sleeping engines and trainer) with 4 engines, once
undisturbed and once with one engine SIGKILLed at the end of every N-th step, in one invocation.

Reports steps/s of both runs and their ratio, how many requests were resubmitted, and the time
from each kill to its replacement serving (synced to the current weights, routed to). The
headline is printed last.

    python bench/recovery.py [steps] [every]      # defaults: 40 steps, a kill every 5
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import sim_env  # noqa: F401  (first: points Ray workers at the sim plugin)

# isort: split

import ray

from relax.core.config import load_config
from relax.core.controller.ray_start import start_loopback_ray
from relax.core.controller.run import run
from relax.core.hookspecs import hookimpl
from relax.core.plugins import get_plugin_manager

ENGINES = 4
SIM = [
    "rollout.engine=sim",
    "trainer.backend=sim",
    "reward.name=sim",
    f"rollout.num_engines={ENGINES}",
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
    "rollout.max_restarts=1000",
]
WARMUP = 2


class Killer:
    """Driver-side plugin: SIGKILLs the lowest-indexed serving engine at the end of every ``every``-th
    step and times each replacement from the kill until the router serves it."""

    def __init__(self, every: int) -> None:
        self.every, self.run = every, None
        self.kills: list[list] = []  # [kill time, serving time or None]
        self.known = set(range(ENGINES))  # engine indices seen so far; a replacement gets a new one
        self.stop = threading.Event()

    @hookimpl
    def relax_on_run_start(self, run):
        self.run = run
        threading.Thread(target=self._watch, daemon=True).start()

    @hookimpl
    def relax_on_step_end(self, step, metrics):
        if step % self.every or step >= self.run.config.total_steps:
            return
        index, handle = min(self.run._state.fleet.live().items())
        pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
        self.kills.append([time.monotonic(), None])
        os.kill(pid, signal.SIGKILL)

    def _watch(self) -> None:
        while not self.stop.is_set():
            new = set(self.run.engine_indices) - self.known
            if new:
                self.known |= new
                pending = [k for k in self.kills if k[1] is None]
                if pending:
                    pending[0][1] = time.monotonic()
            time.sleep(0.01)


def measure(steps: int, root: Path, name: str, every: int | None = None) -> tuple[float, dict, list]:
    killer = Killer(every) if every else None
    if killer:
        get_plugin_manager().pm.register(killer, name="recovery-bench-killer")
    run_dir = root / name
    try:
        run(load_config(None, [*SIM, f"total_steps={steps}", f"run_dir={run_dir}"]))
    finally:
        if killer:
            killer.stop.set()
            get_plugin_manager().pm.unregister(killer)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP:]
    rate = len(timed) / (timed[-1]["timestamp"] - rows[WARMUP - 1]["timestamp"])
    return rate, rows[-1], killer.kills if killer else []


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else 40
    every = int(argv[1]) if len(argv) > 1 else 5
    start_loopback_ray(
        num_cpus=2 * ENGINES + 2
    )  # 127.0.0.1 only, as `relax run` starts Ray; workers inherit the env
    with tempfile.TemporaryDirectory() as tmp:
        base, _, _ = measure(steps, Path(tmp), "undisturbed")
        rate, last, kills = measure(steps, Path(tmp), "killed", every)
    ray.shutdown()
    recoveries = [serving - killed for killed, serving in kills if serving is not None]
    print(
        f"{'run':<12} {'steps/s':>8} {'vs undisturbed':>15} {'kills':>6} {'restarts':>9} {'resubmitted':>12}"
    )
    print(f"{'undisturbed':<12} {base:>8.3f} {1.0:>14.2f}x {0:>6} {0:>9} {0:>12}")
    print(
        f"{'killed':<12} {rate:>8.3f} {rate / base:>14.2f}x {len(kills):>6} {last.get('fault/engine_restarts', 0):>9.0f} "
        f"{last.get('fault/resubmitted_requests', 0):>12.0f}"
    )
    if recoveries:
        print(
            f"kill -> replacement serving: median {statistics.median(recoveries):.2f}s, max {max(recoveries):.2f}s "
            f"over {len(recoveries)} of {len(kills)} kills (rollout.restart_backoff_s included)"
        )
    print(
        f"recovery: {rate / base:.2f}x throughput with one of four engines killed every {every} steps vs undisturbed"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
