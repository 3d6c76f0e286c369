"""Build what the omni quick-starts need, locally and offline: two tiny models (Qwen2.5-VL, and a Qwen2.5-Omni
thinker) from configs with locally built tokenizers and processors, and the generated media task.

    python examples/omni/prepare.py            # -> runs/omni/{models,data}
    relax run examples/quickstart_omni_vl.yaml
    relax run examples/quickstart_omni_audio.yaml

Nothing is downloaded and no media file is committed: rerunning rebuilds the same files (seeded).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# quick-start name -> (model family, media kinds in its dataset)
TASKS = {"vl": ("qwen2_5_vl", ("image", "video")), "audio": ("qwen2_5_omni", ("audio", "image"))}


def prepare(out: str | Path, rows: int = 96, seed: int = 0) -> dict[str, tuple[str, Path]]:
    """Model directory and dataset JSONL per quick-start under ``out``."""
    from relax.core.testing.multimodal_models import build_tiny_multimodal
    from relax.omni.synthetic import make_dataset

    out = Path(out)
    made = {}
    for task, (family, kinds) in TASKS.items():
        model = out / "models" / family
        if not (model / "config.json").exists():
            build_tiny_multimodal(model, family)
        made[task] = (str(model), make_dataset(out / "data" / task, kinds, rows, seed=seed))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/omni", help="where models and data go (default: runs/omni)")
    parser.add_argument("--rows", type=int, default=96, help="dataset rows per quick-start")
    args = parser.parse_args()
    for task, (model, data) in prepare(args.out, args.rows).items():
        print(f"{task}: model {model}, data {data}")


if __name__ == "__main__":
    main()
