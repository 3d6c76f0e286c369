"""One rank of a multi-process megatron check, run as a script by the tests (gloo, OMP_NUM_THREADS=1).

``--mode convert``: build the tiny Qwen3 at the given TP size, load this rank's HF shard, score
``--input`` (a token tensor) vocab-parallel, gather the weights back to HF names.
``--mode train``: a ``MegatronTrainer`` at that TP size scores ``--input`` (a batch with old logprobs),
takes one train step and exports its weights. Rank 0 saves the results to ``--out``.
"""

from __future__ import annotations

import argparse
import os

os.environ["OMP_NUM_THREADS"] = "1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--mode", choices=["convert", "train"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    results = (convert_check if args.mode == "convert" else train_check)(args)
    if args.rank == 0:
        torch.save(results, args.out)
    torch.distributed.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def train_check(args: argparse.Namespace) -> dict:
    import torch

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        args.model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, eps=1e-4, micro_batch_size=4,
        tensor_parallel=args.world, rank=args.rank, world_size=args.world, master_addr="127.0.0.1", master_port=args.port,
    )  # fmt: skip
    batch = torch.load(args.input)
    before = trainer.forward_logprobs(batch)
    metrics = trainer.train_step(batch)
    weights = {n: t.clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket}
    return {"logprobs": before, "metrics": metrics, "weights": weights}


def convert_check(args: argparse.Namespace) -> dict:
    import torch
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from relax.megatron import convert
    from relax.megatron.logprobs import logprobs_and_entropy
    from relax.megatron.parallel import ensure_process_group, gather_tp_shards, initialize_model_parallel

    ensure_process_group(args.rank, args.world, "127.0.0.1", args.port, timeout_s=60)
    initialize_model_parallel(tensor_parallel=args.world, pipeline_parallel=1, seed=0)
    config = AutoConfig.from_pretrained(args.model_dir)
    tp_rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    model = convert.build_gpt_model(config, tensor_model_parallel_size=args.world)
    convert.load_hf_into(model, convert.read_hf_checkpoint(args.model_dir), config, args.world, tp_rank)
    model.eval()
    tokens = torch.load(args.input)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(inputs, torch.arange(inputs.shape[1])[None].expand_as(inputs), attention_mask=None)
        logprobs, entropy = logprobs_and_entropy(logits, targets, tp_rank * logits.shape[-1], group)
    local = convert.weights_only(model.state_dict())
    hf_back = convert.megatron_to_hf(gather_tp_shards(local, args.world, group), config)
    return {"logits_shape": tuple(logits.shape), "logprobs": logprobs, "entropy": entropy, "hf": hf_back}


if __name__ == "__main__":
    main()
