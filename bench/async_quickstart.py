"""Real tiny model: quick-start seconds per step in async/hybrid vs colocate, same machine, one run.

On a 2-core CPU the engine and the trainer compete for the same cores, so the overlap that async
buys on separate accelerators mostly cannot appear here; this bench reports what does.

    python bench/async_quickstart.py [steps]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from relax.core.config import load_config
from relax.core.controller.run import run

COMMON = [
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_every=0",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]


def seconds_per_step(root: Path, steps: int, *overrides: str) -> float:
    run_dir = root / "-".join(o.replace("=", "") for o in overrides) if overrides else root / "colocate"
    run(load_config(None, [*COMMON, f"total_steps={steps}", f"run_dir={run_dir}", *overrides]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (rows[-1]["timestamp"] - rows[1]["timestamp"]) / (len(rows) - 2)


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv else 12
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = seconds_per_step(root, steps)
        print(f"colocate            {base:.3f} s/step")
        results = {}
        for mode, staleness in [("async", 1), ("async", 2), ("hybrid", 1)]:
            sps = seconds_per_step(root, steps, f"mode={mode}", f"max_staleness={staleness}")
            results[(mode, staleness)] = base / sps
            print(f"{mode:<7} staleness {staleness}  {sps:.3f} s/step  {base / sps:.2f}x", flush=True)
    print(
        f"async_quickstart: {results[('async', 1)]:.2f}x async (max_staleness=1) vs colocate steps/s on the real tiny model"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
