"""One rank of a multi-GPU megatron check (NCCL, ``cuda:<rank>``), run as a script by ``test_gpu.py``.

``--mode tp``: a ``MegatronTrainer`` at TP = world size; ``--mode dp`` / ``dp_distopt`` (``pp`` /
``pp_distopt``): at DP (PP) = world size, with the trainer's AdamW or megatron's DistributedOptimizer; ``--mode cp``
(``test_gpu_cp.py``): at context_parallel = world size (1 for the reference) on Transformer Engine's layer spec.
Each scores ``batch`` (fp32 or ``--dtype``),
takes one train step and exports its weights; rank 0 saves {"logprobs", "metrics", "weights"} to ``--out``.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--model-dir", "--input", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--mode", choices=["tp", "dp", "dp_distopt", "pp", "pp_distopt", "cp"], required=True)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import torch

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    kind = {"tp": "tensor", "pp": "pipeline", "pp_distopt": "pipeline", "cp": "context"}.get(
        args.mode, "data"
    )
    layout = {f"{kind}_parallel": args.world}
    trainer = MegatronTrainer(
        args.model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        lr=1e-2,
        eps=1e-4,
        micro_batch_size=4,
        rank=args.rank,
        world_size=args.world,
        master_addr="127.0.0.1",
        master_port=args.port,
        device="cuda",
        dtype=args.dtype,
        distributed_optimizer=args.mode.endswith("_distopt"),
        layer_spec="te" if args.mode == "cp" else "auto",  # CP runs in TE's attention only
        **layout,
    )
    batch = torch.load(args.input)["batch"]
    logprobs = trainer.forward_logprobs(batch)
    metrics = trainer.train_step({**batch, "old_logprobs": logprobs})
    weights = {n: t.float().clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket}
    if args.rank == 0:
        torch.save({"logprobs": logprobs, "metrics": metrics, "weights": weights}, args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
