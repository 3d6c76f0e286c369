"""One rank of the multi-process check of ``test_families.py`` (gloo, OMP_NUM_THREADS=1): a family's tiny
model at the input's ``layout`` (e.g. TP = EP = 2: experts carved from the TP ranks, sequence parallelism on,
as MoE at TP > 1 needs): a trainer's logprobs, one step and its export.
Rank 0 saves them to ``--out``."""

from __future__ import annotations

import argparse
import os

os.environ["OMP_NUM_THREADS"] = "1"


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--model-dir", "--input", "--mode", "--out"):
        ap.add_argument(name, required=True)
    args = ap.parse_args()

    import torch

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    data = torch.load(args.input)
    batch = data["batch"]
    layout = dict(
        **data["layout"],
        rank=args.rank,
        world_size=args.world,
        master_addr="127.0.0.1",
        master_port=args.port,
    )
    results = {}
    objective = build_policy_objective(AlgorithmConfig())
    trainer = MegatronTrainer(
        args.model_dir, objective=objective, lr=1e-2, eps=1e-4, micro_batch_size=4, **layout
    )
    results["logprobs"] = trainer.forward_logprobs(batch)
    results["metrics"] = trainer.train_step(batch)
    results["weights"] = {n: t.clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket}
    if args.rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
