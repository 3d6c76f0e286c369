import json
from pathlib import Path

from relax.core.hookspecs import hookimpl


def arguments(parser):
    parser.add_argument("run_dir", help="a run directory written by `relax run`")


def last_reward(ns) -> int:
    lines = (Path(ns.run_dir) / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    print(f"step {last['step']:.0f}: reward/mean {last['reward/mean']:.3f}")
    return 0


@hookimpl
def relax_register_commands(register):
    register("last-reward", last_reward, help="print a run's latest reward", arguments=arguments)
