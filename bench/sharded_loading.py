"""Host memory per fsdp rank while loading: each rank reading only its shards vs every rank loading the
whole model first (the trainer before issue 39, and still its path for LoRA), on the same checkpoint.

A Qwen3-shaped causal LM built from a config (``--hidden``, ``--layers``, vocabulary 32768, untied head;
defaults: ~218 M parameters, 0.87 GB in fp32) is saved once; then ``--world`` fsdp ranks, each a fresh
process (``relax.core.testing.sharded_rss``), build the trainer both ways. Each rank's peak resident set
while building it (``VmHWM`` minus what it held before: interpreter, libraries, tokenizer) is compared
with a full fp32 copy of the weights (what every rank held before) and between the two ways; rank 0 also
checks that every weight it gathers equals the checkpoint's. The megatron trainer at TP and at PP = ``--world``
is measured the same way (its rows only: ``relax.megatron.load_rss``, megatron's imports warmed too); each rank
checks every weight it holds against its shard of the whole-checkpoint conversion.

    python bench/sharded_loading.py [--hidden 1024] [--layers 12] [--world 2]
"""

from __future__ import annotations

import argparse
import tempfile

from relax.core.testing.sharded_rss import free_port, model_bytes, run_world, write_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = write_model(root, hidden=args.hidden, layers=args.layers)
        full = model_bytes(model)
        print(
            f"model: {full / 4 / 1e6:.0f} M parameters, a full fp32 copy is {full / 2**20:.0f} MiB; world {args.world}"
        )
        peaks = {}
        for mode in ("full", "sharded"):
            reports = run_world(model, args.world, mode, free_port())
            if reports[0]["equal"] != reports[0]["compared"]:
                raise SystemExit(
                    f"{mode}: {reports[0]['compared'] - reports[0]['equal']} weights differ from the checkpoint"
                )
            peaks[mode] = max(r["peak_bytes"] for r in reports)
            per_rank = ", ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in reports)
            print(
                f"{mode:>8}: peak MiB per rank [{per_rank}] = {peaks[mode] / full:.2f}x a full copy "
                f"({reports[0]['equal']} weights equal the checkpoint's)"
            )
        for mode in (
            "megatron_tp",
            "megatron_pp",
        ):  # relax-megatron's trainer at TP or PP = world (rank_load.py)
            reports = run_world(model, args.world, mode, free_port(), module="relax.megatron.load_rss")
            if differ := sum(r["compared"] - r["equal"] for r in reports):
                raise SystemExit(f"{mode}: {differ} weights differ from the rank's shard of the checkpoint")
            per_rank = ", ".join(f"{r['peak_bytes'] / full:.2f}" for r in reports)
            equal = sum(r["equal"] for r in reports)
            print(
                f"{mode:>11}: peak per rank [{per_rank}]x a full copy ({equal} rank weights equal their shard)"
            )
    print(
        f"sharded_loading: {peaks['sharded'] / peaks['full']:.2f}x peak host RSS per rank, sharded vs "
        f"whole-model load ({peaks['sharded'] / full:.2f}x vs {peaks['full'] / full:.2f}x a full fp32 copy, "
        f"world {args.world})"
    )


if __name__ == "__main__":
    main()
