"""How a backend lays a model over its GPUs, as far as memory is concerned.

A trainer or engine backend says how it splits the model by giving its ``backend_params`` /
``engine_params`` a ``memory_layout(cfg)`` method (the :class:`DeclaresLayout` protocol) that returns
one of the layouts below, built with the helpers here; core's own backends do it too. A backend
without the method gets no plan (the table says so) rather than a guessed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

#: bytes per element of a dtype name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TrainLayout:
    """One trainer rank's share of the model and of its training state.

    Splits: ``dense_split`` divides every non-expert weight (tensor x pipeline parallel, or FSDP's
    shards), ``expert_split`` the routed experts (x expert parallel). Each state term holds
    ``bytes`` per parameter of the rank's split, further divided by its ``*_shards`` (a sharded
    optimizer divides masters and Adam moments over data-parallel ranks)."""

    world: int  # ranks, one GPU each
    dense_split: int = 1
    expert_split: int = 1
    tensor_parallel: int = 1  # splits each layer's activations' head / MLP dims
    sequence_parallel: bool = False  # also the hidden-size activations (norms, residuals)
    context_parallel: int = 1  # splits every activation's tokens
    pipeline_parallel: int = (
        1  # layers per stage = layers / PP; the first stage keeps PP micro-batches in flight
    )
    weight_bytes: int = 2  # the model copy the forward reads (compute dtype); 0 when the masters are it
    master_bytes: int = 4  # fp32 master weights (or the fp32 parameters themselves)
    grad_bytes: int = 4
    optimizer_bytes: int = 8  # AdamW's two fp32 moments
    master_shards: int = 1
    grad_shards: int = 1
    optimizer_shards: int = 1
    gathered_layers: int = 0  # FSDP: full layers gathered at once in the compute dtype (this one + prefetch)
    flash_attention: bool = True  # False: the (heads x S x S) scores are materialised (eager attention)
    chunked_logits: bool = True  # False: the (tokens x V / TP) logits of a micro-batch exist at once
    cast_cache: bool = False  # torch autocast keeps a compute-dtype copy of every weight through the backward
    offload_to_host: bool = False  # parameters and optimizer state live in host memory (FSDP cpu_offload)
    note: str = ""


@dataclass(frozen=True)
class EngineLayout:
    """One generation engine: ``gpus`` GPUs (tensor parallel x servers), each holding 1/``tensor_parallel`` of
    the weights. ``static_fraction``: the share of each GPU the engine takes for weights + KV cache at start
    (SGLang's ``mem_fraction_static``); None: weights plus the KV cache of ``kv_tokens`` tokens."""

    gpus: int
    tensor_parallel: int = 1
    weight_bytes: int = 2
    static_fraction: float | None = None
    kv_tokens: int = 0  # static_fraction None: the tokens its KV cache holds at most
    kv_cap_tokens: int | None = None  # a cap on the KV pool (SGLang max_total_tokens)
    runtime_gib: float = 2.0  # what the engine keeps besides weights + KV (CUDA graphs, activations, context)
    releases_memory: bool = False  # colocate: weights + KV leave the GPU while the trainer trains
    note: str = ""


@runtime_checkable
class DeclaresLayout(Protocol):
    """``backend_params`` / ``engine_params`` of a backend that runs on GPUs."""

    def memory_layout(self, cfg: Any) -> TrainLayout | EngineLayout | None:
        """None: this configuration puts nothing on a GPU (e.g. ``device: cpu``)."""


def precision(dtype: str) -> tuple[int, int]:
    """(compute bytes, master bytes) of a trainer in ``dtype``: a half-precision run keeps fp32 masters."""
    compute = DTYPE_BYTES.get(dtype, 4)
    return compute, 4


def replicated(
    world: int, dtype: str, *, autocast: bool, flash_attention: bool = True, note: str = ""
) -> TrainLayout:
    """Data parallel with a full copy per rank: fp32 parameters (the masters), fp32 grads and AdamW state,
    and with ``autocast`` in half precision a compute-dtype copy of every weight while the step runs."""
    compute, _ = precision(dtype)
    return TrainLayout(
        world=world,
        weight_bytes=0,
        cast_cache=autocast and compute < 4,
        flash_attention=flash_attention,
        note=note,
    )


def sharded(
    world: int, dtype: str, *, context_parallel: int = 1, offload: bool = False, note: str = ""
) -> TrainLayout:
    """FSDP: fp32 parameters, grads and AdamW state sharded over ``world`` ranks; each layer gathered in the
    compute dtype for its forward and backward (this layer and the prefetched next)."""
    return TrainLayout(
        world=world,
        weight_bytes=0,
        master_shards=world,
        grad_shards=world,
        optimizer_shards=world,
        gathered_layers=2,
        context_parallel=context_parallel,
        offload_to_host=offload,
        note=note,
    )


def model_parallel(
    tensor: int,
    pipeline: int,
    data: int,
    expert: int,
    dtype: str,
    *,
    distributed_optimizer: bool,
    sequence_parallel: bool,
    flash_attention: bool,
    chunked_logits: bool,
    note: str = "",
) -> TrainLayout:
    """Tensor x pipeline (x expert) parallel weights in the compute dtype with fp32 masters, fp32 grads and
    AdamW state; a distributed optimizer shards masters and moments over the data-parallel ranks (the fp32
    grad buffer stays whole)."""
    compute, _ = precision(dtype)
    shards = data if distributed_optimizer else 1
    return TrainLayout(
        world=tensor * pipeline * data,
        dense_split=tensor * pipeline,
        expert_split=expert * pipeline,
        tensor_parallel=tensor,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=pipeline,
        weight_bytes=compute if compute < 4 else 0,
        master_shards=shards,
        optimizer_shards=shards,
        flash_attention=flash_attention,
        chunked_logits=chunked_logits,
        note=note,
    )


def layout_of(params: Any, cfg: Any) -> TrainLayout | EngineLayout | None | str:
    """The layout a backend's params declare; a string (why) when they declare none."""
    if isinstance(params, DeclaresLayout):
        return params.memory_layout(cfg)
    return f"{type(params).__name__} declares no memory_layout(cfg): not planned"
