"""Process-group set-up for megatron-core on this rank (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

#: a collective's default patience (the trainer passes ``trainer.timeout_s``): long enough for ``save_hf``,
#: which gathers the whole model on every rank while rank 0 writes it
DEFAULT_TIMEOUT_S = 600.0


def ensure_process_group(
    rank: int = 0,
    world_size: int = 1,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
) -> None:
    """Join (or reuse) the default process group (core's ``join_default_group``): ``backend``, or by
    default NCCL when a GPU is present, else gloo; every collective on it waits at most ``timeout_s``."""
    from relax.core.trainers.process_group import join_default_group

    join_default_group(
        rank,
        world_size,
        master_addr,
        master_port,
        backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        timeout_s,
    )


def initialize_model_parallel(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 0,
    expert_parallel: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    context_parallel: int = 1,
) -> None:
    """Initialise megatron's parallel state (its TP / CP / PP / DP / EP groups, rank order tp-cp-ep-dp-pp wait at most ``timeout_s``,
    rounded up to whole minutes as megatron takes it) and its RNG tracker over an already initialised
    ``torch.distributed`` default group; applies the CPU patches megatron needs here (every one without a
    GPU; on a GPU host without Transformer Engine, the MoE router's: see :mod:`relax.megatron.cpu_compat`).

    Idempotent for the same sizes; a different layout while one is active is an error, not a silent reuse.
    """
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp
    from relax.megatron.cpu_compat import ensure_cpu_compat  # a no-op when a GPU is present

    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "initialise torch.distributed (gloo on CPU, nccl on GPU) before megatron's parallel state"
        )
    ensure_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if have != (tensor_parallel, pipeline_parallel, expert_parallel, context_parallel):
            raise RuntimeError(f"megatron parallel state is already initialised with (TP, PP, EP, CP)={have}")
    else:
        # expert tensor parallelism 1: an MoE layer's experts whole on each TP rank (moe.py)
        parallel_state.initialize_model_parallel(
            tensor_parallel,
            pipeline_parallel,
            context_parallel_size=context_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=1,
            distributed_timeout_minutes=timeout_minutes(timeout_s),
        )
    mtp.model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def world_of_one(store_path: str, backend: str = "gloo") -> Iterator[None]:
    """``torch.distributed`` (``backend``, world size 1) + megatron's parallel state at TP=1 PP=1, torn down
    afterwards with the CPU patches, so whatever runs next sees an untouched torch (tests, one process)."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from relax.megatron import cpu_compat

    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=0, world_size=1)
    try:
        initialize_model_parallel(tensor_parallel=1, pipeline_parallel=1, seed=1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.remove()  # on a GPU machine: at most the MoE router's (without Transformer Engine)


def check_layout(world_size: int, tp: int, pp: int, dp: int, ep: int, cp: int = 1) -> None:
    """The rank layout's arithmetic, each error naming the fields."""
    if world_size != tp * cp * pp * dp:
        raise ValueError(
            f"world_size={world_size} != tensor_parallel={tp} x "
            + (f"context_parallel={cp} x " if cp > 1 else "")
            + f"pipeline_parallel={pp} x data_parallel={dp}"
        )
    if (tp * cp * dp) % ep:
        names = "tensor_parallel x " + ("context_parallel x " if cp > 1 else "") + "data_parallel"
        raise ValueError(
            f"expert_parallel={ep} must divide {names}={tp * cp * dp}: expert-"
            "parallel ranks are carved from those, as in megatron (expert tensor parallelism 1)"
        )


def sequence_parallel_on(asked: bool, tp: int, moe: bool) -> bool:
    """Whether the sequence splits over the TP ranks: when asked, and by itself for an MoE model at TP > 1
    (megatron's MoE layer needs it there, ``moe_layer.py``)."""
    if asked and tp == 1:
        raise ValueError(
            "sequence_parallel: needs tensor_parallel > 1 (it splits the sequence over the TP ranks)"
        )
    return tp > 1 and (asked or moe)


def timeout_minutes(timeout_s: float) -> int:
    """megatron's ``distributed_timeout_minutes`` for a timeout in seconds (whole minutes, at least 1)."""
    return max(1, math.ceil(timeout_s / 60))


def model_overrides(
    pipeline_parallel: int,
    expert_parallel: int,
    dtype: torch.dtype,
    per_token_loss: bool,
    sequence_parallel: bool = False,
    recompute: str = "off",
    context_parallel: int = 1,
) -> dict[str, Any]:
    """The layout and precision fields of the model's ``TransformerConfig``, one dict (each key once).

    ``calculate_per_token_loss``: core's objective already divides by step-global token counts, so
    neither megatron's PP schedule (PP > 1) nor its DDP (``per_token_loss``: with the distributed
    optimizer) may rescale the loss or average gradients over DP."""
    out: dict[str, Any] = {}
    if pipeline_parallel > 1:
        out.update(pipeline_model_parallel_size=pipeline_parallel, pipeline_dtype=dtype)
    if pipeline_parallel > 1 or per_token_loss:
        out["calculate_per_token_loss"] = True
    if dtype == torch.bfloat16:  # parameters in bf16; logprobs, entropy and the loss in fp32 (logprobs.py)
        out.update(params_dtype=torch.bfloat16, bf16=True)
    if expert_parallel > 1:
        out["expert_model_parallel_size"] = expert_parallel
    if sequence_parallel:  # TP > 1: activations outside attention / MLP split along the sequence (padding.py)
        out["sequence_parallel"] = True
    if context_parallel > 1:  # Transformer Engine's attention: KV chunks passed around the CP ring
        out.update(context_parallel_size=context_parallel, cp_comm_type="p2p")
    out.update(RECOMPUTE[recompute])
    return out


#: ``trainer.recompute`` as megatron's TransformerConfig fields: ``full`` re-runs every layer in backward
#: (one layer per checkpoint), ``selective`` only core attention (the part whose activations grow with length^2)
RECOMPUTE: dict[str, dict[str, Any]] = {
    "off": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


def rank_device(device: str, rank: int) -> torch.device:
    """The torch device of this rank: ``cpu``, or for ``cuda`` the rank's local GPU (``cuda:<rank mod
    visible GPUs>``: Ray gives each rank actor one GPU through CUDA_VISIBLE_DEVICES, so that is
    ``cuda:0`` there; one process per GPU on a multi-GPU host otherwise). ``cuda:N`` is taken as is."""
    if device == "cpu":
        return torch.device("cpu")
    if not device.startswith("cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={device!r}: no CUDA GPU is visible to this process "
            "(torch.cuda.is_available() is False); use device: cpu"
        )
    if device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


def gather_tp_shards(local: dict[str, torch.Tensor], tp: int, group=None) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's tensors (same names on every rank), in rank order; TP=1 returns ``[local]``."""
    if tp == 1:
        return [local]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[rank][name] = part
    return shards


def rank_rows(batch: dict[str, torch.Tensor], dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's contiguous share of the batch's rows (core's ``shard_bounds``), padded
    with fully masked copies of row 0 to ``ceil(rows / dp)`` rows: every replica runs the same shapes
    (the MoE dispatcher gathers tokens across replicas) and joins every collective, padding contributing 0."""
    from relax.core.policy_update.batching import shard_bounds, take_rows

    rows = batch["responses"].shape[0]
    start, end = shard_bounds(rows, dp_rank, dp)
    share, missing = take_rows(batch, start, end), -(-rows // dp) - (end - start)
    if not missing:
        return share
    pad = {
        **take_rows(batch, 0, missing),
        "response_mask": torch.zeros_like(batch["response_mask"][:missing]),
    }
    if batch.get("routed_experts") is not None:  # MoE routing replay: a padding row routes itself, unmeasured
        pad["routed_experts"] = torch.full_like(pad["routed_experts"], -1)
    per_row = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows]
    return {**share, **{k: torch.cat([share[k], pad[k]]) for k in per_row}}


def gather_rows(local: torch.Tensor, total_rows: int, dp: int, group) -> torch.Tensor:
    """The batch's rows in order, on every rank, from every data-parallel rank's :func:`rank_rows` share
    (scored: the same padded shape on every rank)."""
    from relax.core.policy_update.batching import shard_bounds

    parts = [torch.empty_like(local) for _ in range(dp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    bounds = (shard_bounds(total_rows, r, dp) for r in range(dp))
    return torch.cat([part[: e - s] for part, (s, e) in zip(parts, bounds, strict=True)])


def all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum every trainable parameter's gradient over ``group`` (the data-parallel ranks) in one flat
    buffer; a parameter this rank's rows did not reach (an unrouted expert) contributes zeros."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(summed)


@contextlib.contextmanager
def recomputing(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """Training forwards under ``trainer.recompute``: megatron recomputes only in training mode (its
    TransformerBlock and Attention check ``self.training``), and the trainer otherwise runs in eval mode.
    Every dropout of the configs built here is 0, so training mode changes nothing else for a dense model."""
    if mode == "off":
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.eval()
