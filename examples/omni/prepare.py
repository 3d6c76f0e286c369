"""Build the omni quick-starts' inputs ahead of a run: a tiny Qwen2.5-VL and a tiny Qwen2.5-Omni thinker (from
configs, with locally built tokenizers and processors) and their generated media tasks.

`relax run examples/quickstart_omni_vl.yaml` (or `..._audio.yaml`) builds the same on first use
(``inputs.name``, relax-omni's ``relax.omni.quickstart``), so this is only needed to fill a cache ahead of
time, e.g. a shared directory that a cluster's nodes read, or before going offline:

    python examples/omni/prepare.py                        # -> $RELAX_CACHE_DIR or ~/.cache/relax
    python examples/omni/prepare.py --cache-dir /shared/relax-cache
    relax run examples/quickstart_omni_vl.yaml inputs.params.cache_dir=/shared/relax-cache

Nothing is downloaded and no media file is committed: the same recipe rebuilds the same files (seeded).
"""

from __future__ import annotations

import argparse

from relax.omni.quickstart import QUICKSTARTS, OmniQuickstartParams, ensure_quickstart

DEFAULT = OmniQuickstartParams()
# quick-start -> (model family, the tasks of its dataset); kept for callers of the former layout
TASKS = {
    "vl": (QUICKSTARTS["omni_vl_quickstart"].family, QUICKSTARTS["omni_vl_quickstart"].tasks),
    "audio": (QUICKSTARTS["omni_audio_quickstart"].family, QUICKSTARTS["omni_audio_quickstart"].tasks),
}


def prepare(
    cache_dir: str | None = None, rows: int = DEFAULT.rows, seed: int = DEFAULT.seed
) -> dict[str, dict[str, str]]:
    """``{inputs name: {"model.path": ..., "data.path": ...}}``, built where missing."""
    return {name: ensure_quickstart(name, rows, seed, cache_dir) for name in QUICKSTARTS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache-dir", help="where to build (default: $RELAX_CACHE_DIR, else ~/.cache/relax)")
    parser.add_argument(
        "--rows", type=int, default=DEFAULT.rows, help=f"dataset rows (default: {DEFAULT.rows})"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT.seed, help="the datasets' seed")
    args = parser.parse_args()
    chosen = {"cache_dir": args.cache_dir, "rows": args.rows, "seed": args.seed}
    overrides = " ".join(
        f"inputs.params.{k}={v}" for k, v in chosen.items() if v not in (None, getattr(DEFAULT, k))
    )
    for name, paths in prepare(args.cache_dir, args.rows, args.seed).items():
        example = f"examples/quickstart_{name.removesuffix('_quickstart')}.yaml"
        print(
            f"{name}: model {paths['model.path']}\n  data {paths['data.path']}\n  relax run {example} {overrides}"
        )


if __name__ == "__main__":
    main()
