"""The cost of crossing nodes: async steps/s with the trainer and the engines on different simulated
nodes vs all on one node, same simulated workload (the sim engine/trainer of ``bench/async_overlap.py``;
everything else -- placement by node label, queue, router, weight sync over the object store -- is the
real Relax code).

The nodes are Ray nodes on this machine, each on its own loopback address (``LocalCluster``), so this
measures Relax's and Ray's cross-node paths (object transfers between raylets, remote scheduling),
not a network: on loopback the ratio is expected at or above 0.9.

    python bench/multinode.py [steps]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import sim_env  # noqa: F401  (first: points Ray workers at the sim plugin)

# isort: split

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.testing.cluster import LocalCluster, NodeSpec

SIM = [
    "rollout.engine=sim",
    "trainer.backend=sim",
    "reward.name=sim",
    "rollout.num_engines=2",
    "mode=async",
    "max_staleness=1",
    "rollout.prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "trainer.recompute_old_logprobs=false",
    "weight_sync.transport=object_store",
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


def measure(address: str, trainer_node: str, rollout_node: str, steps: int, run_dir: Path) -> float:
    run(
        load_config(
            None,
            [
                *SIM,
                f"total_steps={steps}",
                f"run_dir={run_dir}",
                f"ray.address={address}",
                f"ray.nodes.trainer={trainer_node}",
                f"ray.nodes.rollout={rollout_node}",
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARMUP:]
    return len(timed) / (timed[-1]["timestamp"] - rows[WARMUP - 1]["timestamp"])


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else 12
    nodes = [NodeSpec("head", 1), NodeSpec("a", 4), NodeSpec("b", 4)]
    with LocalCluster(nodes) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.connect()
        one = measure(cluster.address, "a", "a", steps, Path(tmp) / "one")
        two = measure(cluster.address, "a", "b", steps, Path(tmp) / "two")
    print(f"{'placement':<34} {'steps/s':>8}")
    print(f"{'trainer + engines on node a':<34} {one:>8.3f}")
    print(f"{'trainer on a, engines on node b':<34} {two:>8.3f}")
    print(f"multinode: {two / one:.2f}x steps/s two nodes vs one")


if __name__ == "__main__":
    main(sys.argv[1:])
