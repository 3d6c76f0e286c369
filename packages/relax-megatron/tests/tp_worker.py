"""One rank of a multi-process megatron check, run as a script by the tests (gloo, OMP_NUM_THREADS=1).

``--mode tensor`` (TP = world size), on ``--input`` = {"tokens", "batch"}: build the tiny Qwen3, load
this rank's HF shard, score the tokens vocab-parallel and gather the weights back to HF names; then a
``MegatronTrainer`` scores the batch (with old logprobs), takes one train step and exports its weights
(and with ``--ckpt`` saves a dist checkpoint, scores the batch again and takes a second step); with
``moe_dir`` in the input, the same ranks then score the tokens with a Qwen3-MoE model at expert
parallelism = world size and take a trainer step on it at DP = EP = world size; with ``pipeline`` =
{"tokens", "ckpt"[, "dp_batch"]} in the input, they then run the pipeline mode's checks on those.
``--mode pipeline`` (PP = world size, 1F1B schedule), on {"tokens"[, "batch"]}: the last stage's
logprobs of the tokens (forward only), then with a batch the same ``MegatronTrainer`` check at PP = world
size (saved to ``--ckpt``; again in bf16; then built with the distributed optimizer's config), then at DP = world size (two micro-batches per replica; saved to
``<ckpt>-dp``). With ``routing`` = {"batch", "moe_dir"} in the tensor mode's input (a batch carrying
``routed_experts``), the ranks also take the trainer check with MoE routing replay at DP = EP = world size, then
at PP = world size. ``moe_tp`` = (model_dir, batch, ckpt) / ``omni_moe_tp`` = (model_dir, batch): Qwen3-MoE / the Qwen3-Omni
thinker at TP = world size (sequence parallelism): a trainer check (Qwen3-MoE: saved to ``ckpt``), and for
Qwen3-MoE frozen trainers' logprobs and exports at EP = 1 and EP = TP, then the dense model's with
``sequence_parallel`` asked for. ``--mode sp_pp`` (world 4), on {name: (model_dir, batch)}: a trainer check of each
at TP=2 x PP=2 (sequence parallelism across pipeline stages). Rank 0 saves the results to ``--out``.
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
    ap.add_argument("--mode", choices=["tensor", "pipeline", "sp_pp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--without", default="", help="a cpu_compat patch to remove (checks it is still needed)")
    ap.add_argument("--ckpt", default="", help="save the TP (tensor mode) or PP (pipeline mode) trainer here")
    args = ap.parse_args()

    import torch
    from megatron.core import parallel_state

    data = torch.load(args.input)
    if args.mode == "tensor":  # one launch for every check: starting processes is the slow part
        results = {
            "convert": convert_check(args, data["tokens"]),
            "train": train_check(args, data["batch"], ckpt=args.ckpt, tensor_parallel=args.world),
        }
        if "moe_dir" in data:  # then the same two processes as expert-parallel ranks
            results["moe"] = moe_check(args, data["moe_dir"], data["tokens"])
            parallel_state.destroy_model_parallel()  # and as DP=2 x EP=2 ranks of a trainer
            moe_batch = {k: v for k, v in data["batch"].items() if k != "old_logprobs"}  # the MoE model's own
            results["moe_train"] = train_check(
                args,
                moe_batch,
                model_dir=data["moe_dir"],
                data_parallel=args.world,
                expert_parallel=args.world,
            )
        if (
            "moe_tp" in data
        ):  # Qwen3-MoE at TP = world size (sequence parallelism; experts whole on each TP rank)
            parallel_state.destroy_model_parallel()
            moe_dir, moe_batch, ckpt = data["moe_tp"]
            results["moe_tp"] = train_check(
                args, moe_batch, model_dir=moe_dir, tensor_parallel=args.world, ckpt=ckpt
            )
            for ep in (
                1,
                args.world,
            ):  # frozen: logprobs and the export, at EP = 1 and EP = TP (the same ranks)
                parallel_state.destroy_model_parallel()
                results["moe_tp"][f"frozen_ep{ep}"] = frozen_check(
                    args, moe_batch, moe_dir, tensor_parallel=args.world, expert_parallel=ep
                )
            parallel_state.destroy_model_parallel()  # the dense Qwen3 with sequence parallelism asked for
            results["dense_sp"] = frozen_check(
                args, moe_batch, args.model_dir, tensor_parallel=args.world, sequence_parallel=True
            )
        if "routing" in data:  # MoE routing replay on the perturbed Qwen3-MoE: DP = EP = world size, then PP
            parallel_state.destroy_model_parallel()
            routing = data["routing"]
            results["routing"] = {
                "ep": train_check(
                    args,
                    routing["batch"],
                    model_dir=routing["moe_dir"],
                    data_parallel=args.world,
                    expert_parallel=args.world,
                    routing_replay=True,
                )
            }
            parallel_state.destroy_model_parallel()
            results["routing"]["pp"] = train_check(
                args,
                routing["batch"],
                model_dir=routing["moe_dir"],
                pipeline_parallel=args.world,
                routing_replay=True,
            )
            parallel_state.destroy_model_parallel()  # and at TP (sequence parallelism: each rank routes its slice)
            results["routing"]["tp"] = train_check(
                args,
                routing["batch"],
                model_dir=routing["moe_dir"],
                tensor_parallel=args.world,
                routing_replay=True,
            )
        for family, (model_dir, batch) in data.get(
            "omni", {}
        ).items():  # media models (omni.py) at TP = world size
            parallel_state.destroy_model_parallel()
            results.setdefault("omni", {})[family] = train_check(
                args,
                batch,
                model_dir=model_dir,
                micro_batch_size=3,
                tensor_parallel=args.world,
                ckpt=data.get("omni_ckpt", {}).get(family, ""),
            )
        for family, (model_dir, batch) in data.get(
            "omni_tp", {}
        ).items():  # dense Omni thinkers (audio) at TP: logprobs
            parallel_state.destroy_model_parallel()
            results.setdefault("omni_tp", {})[family] = logprobs_check(
                args, batch, model_dir, tensor_parallel=args.world
            )
        if (
            "omni_moe_tp" in data
        ):  # the MoE Omni thinker at TP = world size (sequence parallelism, DeepStack sliced)
            parallel_state.destroy_model_parallel()
            model_dir, batch = data["omni_moe_tp"]
            results["omni_moe_tp"] = train_check(
                args, batch, model_dir=model_dir, micro_batch_size=3, tensor_parallel=args.world
            )
        if "omni_moe" in data:  # the MoE Omni thinker at DP = EP = world size
            parallel_state.destroy_model_parallel()
            model_dir, batch = data["omni_moe"]
            results["omni_moe"] = train_check(
                args,
                batch,
                model_dir=model_dir,
                micro_batch_size=3,
                data_parallel=args.world,
                expert_parallel=args.world,
            )
        if "pipeline" in data:  # then as pipeline stages and data-parallel replicas
            parallel_state.destroy_model_parallel()
            pipeline = data["pipeline"]
            results["pipeline"] = pipeline_checks(
                args, pipeline["tokens"], data["batch"], pipeline["ckpt"], pipeline.get("dp_batch")
            )
        for family, (model_dir, batch) in data.get(
            "omni", {}
        ).items():  # and the media models at PP = world size
            parallel_state.destroy_model_parallel()
            results["omni_pp"] = results.get("omni_pp", {})
            results["omni_pp"][family] = train_check(
                args, batch, model_dir=model_dir, micro_batch_size=3, pipeline_parallel=args.world
            )
        for family, (model_dir, batch) in data.get(
            "omni_thinkers", {}
        ).items():  # the Omni thinkers at PP: logprobs
            parallel_state.destroy_model_parallel()
            results.setdefault("omni_thinkers_pp", {})[family] = logprobs_check(
                args, batch, model_dir, pipeline_parallel=args.world
            )
    elif args.mode == "sp_pp":
        results = {}
        for name, (model_dir, batch) in data.items():
            parallel_state.destroy_model_parallel()
            results[name] = train_check(
                args,
                batch,
                model_dir=model_dir,
                micro_batch_size=3,
                tensor_parallel=2,
                pipeline_parallel=args.world // 2,
            )
    else:
        results = pipeline_checks(args, data["tokens"], data.get("batch"), args.ckpt)
    if args.rank == 0:
        torch.save(results, args.out)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def pipeline_checks(
    args: argparse.Namespace, tokens, batch: dict | None, ckpt: str, dp_batch: dict | None = None
) -> dict:
    """PP = world size: forward-only logprobs of ``tokens``; with ``batch`` a trainer check at PP = world
    size (saved to ``ckpt``), then on ``dp_batch`` (default ``batch``) at DP = world size (micro-batches of
    two, saved to ``<ckpt>-dp``)."""
    from megatron.core import parallel_state

    results = {"logprobs": pipeline_check(args, tokens)}
    if batch is not None:
        results["train"] = train_check(args, batch, ckpt=ckpt, pipeline_parallel=args.world)
        parallel_state.destroy_model_parallel()  # the same stages in bf16 (fp32 masters, hooks under 1F1B)
        own_old = {k: v for k, v in batch.items() if k != "old_logprobs"}  # scored by the bf16 model itself
        results["bf16"] = train_check(args, own_old, pipeline_parallel=args.world, dtype="bfloat16")
        parallel_state.destroy_model_parallel()  # the same stages with the distributed optimizer's config
        results["distopt"] = distopt_pipeline_check(args)
        parallel_state.destroy_model_parallel()  # the same processes as data-parallel replicas
        results["dp"] = train_check(
            args,
            batch if dp_batch is None else dp_batch,
            micro_batch_size=2,
            ckpt=ckpt and ckpt + "-dp",
            data_parallel=args.world,
        )
    return results


def train_check(
    args: argparse.Namespace,
    batch: dict,
    model_dir: str = "",
    micro_batch_size: int = 4,
    ckpt: str = "",
    dtype: str = "float32",
    **layout: int | bool,
) -> dict:
    """A ``MegatronTrainer`` at ``layout`` on ``model_dir`` (default ``--model-dir``): logprobs, one step,
    the exported weights; with ``ckpt`` a save there, logprobs after it and a second step. Scores five
    tokens at a time (chunked.py: several chunks, recomputed in backward, vocab-parallel at TP > 1)."""

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        model_dir or args.model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        lr=1e-2,
        eps=1e-4,
        micro_batch_size=micro_batch_size,
        rank=args.rank,
        dtype=dtype,
        logits_chunk_tokens=5,
        **layout,
        world_size=args.world,
        master_addr="127.0.0.1",
        master_port=args.port,
    )
    before = trainer.forward_logprobs(batch)
    sum_pi_squared = trainer.forward_logprobs_and_sum_pi_squared(batch)
    metrics = trainer.train_step(batch)
    weights = {n: t.clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket}
    out = {"logprobs": before, "sum_pi_squared": sum_pi_squared, "metrics": metrics, "weights": weights}
    if ckpt:
        trainer.save(ckpt)
        out["logprobs_after"] = trainer.forward_logprobs(batch)
        out["second"] = trainer.train_step(batch)  # what a resumed trainer must repeat
        out["weights_second"] = {
            n: t.clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket
        }
    return out


def logprobs_check(args: argparse.Namespace, batch: dict, model_dir: str, **layout: int):
    """A frozen ``MegatronTrainer``'s logprobs at ``layout``: a scoring check, cheaper than :func:`train_check`."""
    from relax.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        model_dir,
        rank=args.rank,
        world_size=args.world,
        master_addr="127.0.0.1",
        master_port=args.port,
        trainable=False,
        **layout,
    )
    return trainer.forward_logprobs(batch)


def frozen_check(args: argparse.Namespace, batch: dict, model_dir: str, **layout: int | bool) -> dict:
    """A frozen ``MegatronTrainer``'s logprobs (from whole logits) and HF-named export at ``layout``."""
    from relax.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        model_dir,
        rank=args.rank,
        world_size=args.world,
        master_addr="127.0.0.1",
        master_port=args.port,
        trainable=False,
        logits_chunk_tokens=0,
        **layout,
    )
    return {
        "logprobs": trainer.forward_logprobs(batch),
        "hf": {n: t.clone() for bucket in trainer.export_weights(1 << 16) for n, t in bucket},
    }


def distopt_pipeline_check(args: argparse.Namespace) -> dict:
    """PP = world size with the distributed optimizer, as the trainer builds it (``model_overrides``):
    the stage's model config, megatron's DDP wrapper, then the error megatron's optimizer raises on CPU."""
    import torch
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from relax.megatron import distopt, gpt_model
    from relax.megatron.parallel import initialize_model_parallel, model_overrides

    initialize_model_parallel(1, args.world, seed=0)
    config = AutoConfig.from_pretrained(args.model_dir)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    model = gpt_model.build_gpt_model(
        config,
        pre_process=pp_rank == 0,
        post_process=pp_rank == args.world - 1,
        **model_overrides(args.world, 1, torch.float32, per_token_loss=True),
    )
    ddp = distopt.wrap_ddp(model)
    out = {
        "pp": model.config.pipeline_model_parallel_size,
        "per_token_loss": model.config.calculate_per_token_loss,
        "ddp": type(ddp).__name__,
        "optimizer_error": None,
    }
    try:
        distopt.optimizer(
            ddp, lr=1e-3, min_lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, bf16=False
        )
    except Exception as error:  # noqa: BLE001 - reported to the test, which names the one it expects
        out["optimizer_error"] = f"{type(error).__name__}: {error}"
    return out


def moe_check(args: argparse.Namespace, model_dir: str, tokens) -> dict:
    """Qwen3-MoE at EP = world size (each rank holds its share of the experts, allgather dispatcher):
    logprobs of ``tokens`` and the EP-gathered weights mapped back to HF names."""
    import torch
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from relax.megatron import convert, gpt_model
    from relax.megatron.parallel import gather_tp_shards, initialize_model_parallel

    parallel_state.destroy_model_parallel()
    initialize_model_parallel(1, 1, seed=0, expert_parallel=args.world)
    config = AutoConfig.from_pretrained(model_dir)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    model = gpt_model.build_gpt_model(config, expert_model_parallel_size=args.world)
    convert.load_hf_into(model, convert.read_hf_checkpoint(model_dir), config, ep=args.world, ep_rank=ep_rank)
    model.eval()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logprobs = -model(
            inputs, torch.arange(inputs.shape[1])[None].expand_as(inputs), attention_mask=None, labels=targets
        )
    local = convert.weights_only(model.state_dict())
    group = parallel_state.get_expert_model_parallel_group()
    return {
        "logprobs": logprobs,
        "hf": convert.megatron_to_hf(gather_tp_shards(local, args.world, group), config),
    }


def pipeline_check(args: argparse.Namespace, tokens) -> dict:
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from transformers import AutoConfig

    from relax.megatron import convert, gpt_model
    from relax.megatron.parallel import ensure_process_group, initialize_model_parallel

    ensure_process_group(args.rank, args.world, "127.0.0.1", args.port, timeout_s=60)
    initialize_model_parallel(tensor_parallel=1, pipeline_parallel=args.world, seed=0)
    if args.without:
        from relax.megatron import cpu_compat

        cpu_compat.remove([args.without])
    config = AutoConfig.from_pretrained(args.model_dir)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    model = gpt_model.build_gpt_model(
        config,
        pre_process=pp_rank == 0,
        post_process=pp_rank == args.world - 1,
        pipeline_model_parallel_size=args.world,
        pipeline_dtype=torch.float32,
    )
    convert.load_hf_into(
        model, convert.read_hf_checkpoint(args.model_dir), config, pp=args.world, pp_rank=pp_rank
    )
    model.eval()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch, positions, attention_mask=None, labels=targets)
        return losses, lambda out: (out.sum(), {"logprobs": -out.detach()})

    with torch.no_grad():
        out = forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step,
            data_iterator=iter([inputs]),
            model=[model],
            num_microbatches=1,
            seq_length=inputs.shape[1],
            micro_batch_size=inputs.shape[0],
            forward_only=True,
        )
    if pp_rank == args.world - 1:  # only the last stage has the losses: hand them to rank 0
        torch.distributed.send(out[0]["logprobs"].contiguous(), dst=0)
        return None
    logprobs = torch.empty(targets.shape)
    torch.distributed.recv(logprobs, src=args.world - 1)
    return logprobs


def convert_check(args: argparse.Namespace, tokens) -> dict:
    import torch
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from relax.megatron import convert, gpt_model
    from relax.megatron.logprobs import logprobs_and_entropy
    from relax.megatron.parallel import ensure_process_group, gather_tp_shards, initialize_model_parallel

    ensure_process_group(args.rank, args.world, "127.0.0.1", args.port, timeout_s=60)
    initialize_model_parallel(tensor_parallel=args.world, pipeline_parallel=1, seed=0)
    config = AutoConfig.from_pretrained(args.model_dir)
    tp_rank, group = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )
    model = gpt_model.build_gpt_model(config, tensor_model_parallel_size=args.world)
    convert.load_hf_into(model, convert.read_hf_checkpoint(args.model_dir), config, args.world, tp_rank)
    model.eval()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(inputs, torch.arange(inputs.shape[1])[None].expand_as(inputs), attention_mask=None)
        logprobs, entropy = logprobs_and_entropy(logits, targets, tp_rank * logits.shape[-1], group)
    local = convert.weights_only(model.state_dict())
    hf_back = convert.megatron_to_hf(gather_tp_shards(local, args.world, group), config)
    return {"logits_shape": tuple(logits.shape), "logprobs": logprobs, "entropy": entropy, "hf": hf_back}


if __name__ == "__main__":
    main()
