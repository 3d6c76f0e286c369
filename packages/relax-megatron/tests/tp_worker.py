"""One rank of a multi-process megatron check, run as a script by the tests (gloo, OMP_NUM_THREADS=1).

Builds the tiny Qwen3 at the given TP size, loads this rank's HF shard, scores fixed tokens
vocab-parallel, gathers the weights back to HF names; rank 0 saves the results to ``--out``.
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
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

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
    tokens = torch.load(args.tokens)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(inputs, torch.arange(inputs.shape[1])[None].expand_as(inputs), attention_mask=None)
        logprobs, entropy = logprobs_and_entropy(logits, targets, tp_rank * logits.shape[-1], group)
    local = convert.weights_only(model.state_dict())
    hf_back = convert.megatron_to_hf(gather_tp_shards(local, args.world, group), config)
    if args.rank == 0:
        torch.save({"logits_shape": tuple(logits.shape), "logprobs": logprobs, "entropy": entropy, "hf": hf_back}, args.out)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
