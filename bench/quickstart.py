"""Quick-start stage breakdown: seconds per step by stage (generate, reward, logprob, train, sync).

Runs the bundled quick-start config for a fixed number of steps with the real tiny model (every
role in this process, as ``relax run`` places them; ``rollout.host=trainer`` for a trainer actor
through real Ray), then prints the per-stage mean seconds. Headline: whole step time vs the sum of the stage
times, i.e. how much the controller/Ray orchestration adds on top of the work itself.

    python bench/quickstart.py [steps] [key.path=value ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from relax.core.config import load_config
from relax.core.controller.run import run

STAGES = ["generate", "reward", "logprob", "train", "sync"]


def main(argv: list[str]) -> None:
    steps = int(argv[0]) if argv and "=" not in argv[0] else 8
    overrides = [a for a in argv if "=" in a]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg = load_config(
            None,
            [
                f"total_steps={steps}",
                f"run_dir={run_dir}",
                "logging.progress=false",
                "logging.console=false",
                "logging.plot=false",
                "logging.tensorboard=false",
                "checkpoint.save_every=0",
                "checkpoint.save_hf_final=false",
                *overrides,
            ],
        )
        run(cfg)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:] or rows  # first step includes warm-up
    mean = {s: sum(r.get(f"time/{s}_s", 0.0) for r in rows) / len(rows) for s in STAGES}
    step = sum(r["time/step_s"] for r in rows) / len(rows)
    print(f"{'stage':<10} {'s/step':>8} {'share':>7}")
    for s in STAGES:
        print(f"{s:<10} {mean[s]:>8.3f} {mean[s] / step:>6.1%}")
    print(f"{'step':<10} {step:>8.3f}")
    print(f"reward mean first/last: {rows[0]['reward/mean']:.3f} / {rows[-1]['reward/mean']:.3f}")
    work = sum(mean.values())
    print(
        f"quickstart: {step / work:.2f}x step time vs sum of stage times ({steps} steps, {step:.3f} s/step)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
