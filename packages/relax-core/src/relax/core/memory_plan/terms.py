"""The memory terms, in bytes, as pure functions of a model shape, a layout and the run's sizes.

Assumptions (docs/memory-plan.md lists them with the measurements behind them):

* training state per parameter: compute-dtype weights (2 bytes in bf16), fp32 masters (4), fp32 grads (4),
  AdamW's two fp32 moments (8), each divided by the layout's split and shards;
* activations kept for backward, per token and decoder layer, in the compute dtype: the layer input,
  norm inputs and outputs (8 x hidden; in half precision the two norms' fp32 upcast inputs on top), q/k/v before and after the
  rotary embedding and the attention output (3 x q_dim + 3 x kv_dim), and the SwiGLU MLP's gate, up, activation
  and product (4 x intermediate; an MoE layer: 4 x expert_intermediate per routed expert of a token plus
  the shared expert, the dispatched copies of the hidden state and fp32 router logits). Tensor
  parallelism divides the head / MLP dims, sequence parallelism the hidden-size ones, context parallelism
  all of them;
* eager attention adds the (heads x S x S) probabilities per layer (fp32 softmax output, plus its
  compute-dtype copy in half precision) and K / V repeated to every query head, and, while a layer runs, fp32 scores and softmax (8 bytes); flash
  attention adds nothing beyond its output;
* full recompute keeps each layer's input, the final norm's input and output and the rotary tables, plus
  one layer's activations while it is recomputed;
* logits: chunked, one chunk of (chunk x V / TP) fp32 logits, softmax and grad (12 bytes each);
  unchunked, the micro-batch's (tokens x V / TP) logits in bf16, their fp32 upcast, softmax and grad
  (14 bytes each);
* KV cache: 2 (K and V) x layers x kv_dim x bytes per token, divided over tensor-parallel ranks.
"""

from __future__ import annotations

from relax.core.memory_plan.layout import TrainLayout
from relax.core.memory_plan.shape import ModelShape

GIB = 1024**3


def split_params(shape: ModelShape, layout: TrainLayout) -> float:
    """Parameters one rank holds before any optimizer sharding (its tensor / pipeline / expert split)."""
    experts = shape.expert_params()
    return (shape.total_params() - experts) / layout.dense_split + experts / layout.expert_split


def state_terms(
    shape: ModelShape, layout: TrainLayout, compute_bytes: int, trainable: float | None = None
) -> dict[str, float]:
    """weights / fp32 masters / grads / optimizer per rank. ``trainable``: parameters trained (LoRA: the
    adapters and modules_to_save); the rest of the model is frozen in the compute dtype."""
    held = split_params(shape, layout)
    train = held if trainable is None else trainable / layout.dense_split
    frozen = held - train
    terms = {
        "weights": layout.weight_bytes * train + frozen * compute_bytes / layout.master_shards,
        "fp32 masters": layout.master_bytes * train / layout.master_shards,
        "gradients": layout.grad_bytes * train / layout.grad_shards,
        "optimizer (AdamW)": layout.optimizer_bytes * train / layout.optimizer_shards,
    }
    if layout.offload_to_host:
        terms = {k: 0.0 for k in terms}
    if layout.gathered_layers:
        terms["gathered layers"] = (
            layout.gathered_layers * shape.largest_layer_params() * 2 / layout.expert_split
        )
    if layout.cast_cache:
        terms["autocast weight copies"] = 2 * train
    return terms


def frozen_weights(shape: ModelShape, dtype_bytes: int, split: int = 1) -> float:
    return shape.total_params() * dtype_bytes / split


def layer_activation_elements(shape: ModelShape, layout: TrainLayout) -> float:
    """Elements one token keeps for backward in one decoder layer (module docstring)."""
    tp, sp = layout.tensor_parallel, layout.tensor_parallel if layout.sequence_parallel else 1
    if shape.moe_layers:
        mlp = (
            4 * shape.expert_intermediate * shape.experts_per_token
            + 4 * shape.shared_expert_intermediate
            + 2 * shape.hidden * shape.experts_per_token
            + 2 * shape.experts
        )
    else:
        mlp = 4 * shape.intermediate
    return (8 * shape.hidden / sp + (3 * shape.q_dim + 3 * shape.kv_dim + mlp) / tp) / layout.context_parallel


def activation_terms(
    shape: ModelShape,
    layout: TrainLayout,
    tokens: int,
    row: int,
    compute_bytes: int,
    recompute: str,
    grad: bool = True,
) -> dict[str, float]:
    """Activations of one micro-batch of ``tokens`` tokens in rows of at most ``row`` tokens.

    ``grad`` False (a no-grad scoring pass): only one layer's transients exist at once."""
    layers = shape.layers / layout.pipeline_parallel
    in_flight = layout.pipeline_parallel  # 1F1B: the first stage holds PP micro-batches' activations
    per_layer = layer_activation_elements(shape, layout) * tokens * compute_bytes
    if compute_bytes < 4:  # RMSNorm upcasts its input to fp32 and keeps it
        per_layer += (
            2
            * shape.hidden
            * 4
            * tokens
            / layout.context_parallel
            / (layout.tensor_parallel if layout.sequence_parallel else 1)
        )
    heads = shape.heads / layout.tensor_parallel
    scores = 0.0 if layout.flash_attention else heads * tokens * row / layout.context_parallel
    if not layout.flash_attention:  # eager attention also keeps K and V repeated to every query head
        per_layer += 2 * (shape.q_dim - shape.kv_dim) / layout.tensor_parallel * tokens * compute_bytes
    transient = scores * 8 + per_layer  # one layer running: fp32 scores + softmax, its outputs
    if not grad:
        return {"activations (no grad, one layer)": transient}
    if recompute == "full":
        inputs = (layers * in_flight + 2) * shape.hidden + 2 * shape.head_dim  # + final norm, rotary tables
        keep = (
            inputs
            * tokens
            * compute_bytes
            / (layout.context_parallel * (layout.tensor_parallel if layout.sequence_parallel else 1))
        )
        return {
            "activations (layer inputs, recompute)": keep,
            "activations (one layer recomputed)": transient,
        }
    kept_scores = (
        0.0 if recompute == "selective" else scores * (4 + (compute_bytes if compute_bytes < 4 else 0))
    )
    kept = layers * in_flight * (per_layer + kept_scores)
    return {"activations": kept, "activations (one layer's scores)": scores * 8}


def logits_terms(shape: ModelShape, layout: TrainLayout, tokens: int, chunk: int) -> dict[str, float]:
    """The output head's logits of one micro-batch (module docstring)."""
    vocab = shape.vocab / layout.tensor_parallel
    if layout.chunked_logits and chunk:
        return {"logits chunk": min(chunk, tokens) * vocab * 12}
    return {"logits (whole micro-batch)": tokens / layout.context_parallel * vocab * 14}


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> float:
    return 2 * shape.layers * shape.kv_dim * dtype_bytes / tensor_parallel
