"""Per-role memory terms of a run: the trainer rank (policy and critic), frozen scoring roles (reference,
teacher) and a generation engine's GPU, from a config, the models' shapes and the backends' layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.core.memory_plan import terms as t
from relax.core.memory_plan.layout import DTYPE_BYTES, EngineLayout, TrainLayout, replicated
from relax.core.memory_plan.shape import ModelShape

RUNTIME_GIB = 1.5  # per process: CUDA context, cuBLAS / NCCL workspaces (measured 1-2 GiB on H100 processes)


@dataclass(frozen=True)
class Sizes:
    """The run's sequence sizes: the longest row and a training micro-batch's tokens (per rank)."""

    row: int
    tokens: int
    chunk: int
    recompute: str


def sizes(cfg: Any) -> Sizes:
    """``row``: prompt + response (agentic: the episode's tokens); ``tokens``: the token budget (a longer row
    runs alone) or ``micro_batch_size`` padded rows."""
    response = cfg.environment.max_total_tokens if cfg.environment.name else cfg.rollout.max_new_tokens
    row = cfg.data.max_prompt_length + response
    budget = cfg.trainer.max_tokens_per_micro_batch
    tokens = max(budget, row) if budget else cfg.trainer.micro_batch_size * row
    return Sizes(
        row=row, tokens=tokens, chunk=cfg.trainer.logits_chunk_tokens, recompute=cfg.trainer.recompute
    )


def lora_params(shape: ModelShape, lora: Any) -> int:
    """Trainable parameters of ``trainer.lora``: rank x (in + out) per targeted projection per layer, plus the
    modules trained in full (``modules_to_save``: the embedding / head)."""
    dims = {
        "q_proj": (shape.hidden, shape.q_dim),
        "k_proj": (shape.hidden, shape.kv_dim),
        "v_proj": (shape.hidden, shape.kv_dim),
        "o_proj": (shape.q_dim, shape.hidden),
        "gate_proj": (shape.hidden, shape.intermediate),
        "up_proj": (shape.hidden, shape.intermediate),
        "down_proj": (shape.intermediate, shape.hidden),
    }
    wanted = lora.target_modules
    targets = dims if "all-linear" in wanted else {k: v for k, v in dims.items() if k in wanted}
    adapters = shape.layers * sum(lora.rank * (a + b) for a, b in targets.values())
    full = sum(shape.vocab * shape.hidden for m in lora.modules_to_save if m in ("lm_head", "embed_tokens"))
    return adapters + full


def trainer_terms(
    shape: ModelShape,
    layout: TrainLayout,
    cfg: Any,
    size: Sizes,
    dtype: str,
    critic: ModelShape | None = None,
) -> dict[str, float]:
    """One trainer rank at its training peak: state, one micro-batch's activations and logits, the weight-sync
    bucket, the CUDA runtime; with a critic (same process) its state too (the two never run backward together,
    so the larger activation peak counts). The critic (``relax.core.trainers.critic``) is a whole fp32 replica
    on every rank with autocast forwards, recomputing as the policy does (``trainer.recompute``)."""
    compute = DTYPE_BYTES.get(dtype, 4)
    lora = getattr(cfg.trainer, "lora", None)
    trainable = lora_params(shape, lora) if lora is not None else None
    out = {f"policy {k}": v for k, v in t.state_terms(shape, layout, compute, trainable).items()}
    recompute = size.recompute
    act = t.activation_terms(shape, layout, size.tokens, size.row, compute, recompute)
    if critic is not None:
        whole = replicated(layout.world, dtype, autocast=True)
        out.update({f"critic {k}": v for k, v in t.state_terms(critic, whole, compute).items() if v})
        critic_act = t.activation_terms(critic, whole, size.tokens, size.row, compute, recompute)
        if sum(critic_act.values()) > sum(act.values()):
            act = {f"critic {k}": v for k, v in critic_act.items()}
    out.update(act)
    out.update(t.logits_terms(shape, layout, size.tokens, size.chunk))
    out["weight-sync bucket"] = cfg.weight_sync.bucket_mb * 2**20
    out["CUDA runtime"] = RUNTIME_GIB * t.GIB
    return out


def resident_terms(trainer: dict[str, float], offload: bool) -> dict[str, float]:
    """What a colocated trainer keeps while the engine generates: weights, fp32 masters and optimizer state
    (none with ``trainer.offload``) and its runtime. Gradients are dropped after each step (``zero_grad`` to
    None), activations and autocast copies freed and the allocator's cache emptied before the engine resumes."""
    state = ("weights", "fp32 masters", "optimizer (AdamW)")
    kept = {k: v for k, v in trainer.items() if k.startswith(("policy ", "critic ")) and k.endswith(state)}
    if offload:
        kept = {}
    return {
        **{f"trainer {k} (resident)": v for k, v in kept.items()},
        "trainer CUDA runtime": RUNTIME_GIB * t.GIB,
    }


def frozen_terms(shape: ModelShape, dtype: str, size: Sizes) -> dict[str, float]:
    """A frozen scoring model (reference, teacher) on one GPU: its weights, a no-grad pass's peak."""
    compute = DTYPE_BYTES.get(dtype, 4)
    layout = TrainLayout(world=1)
    out = {"weights": t.frozen_weights(shape, compute)}
    out.update(t.activation_terms(shape, layout, size.tokens, size.row, compute, "off", grad=False))
    out.update(t.logits_terms(shape, layout, size.tokens, size.chunk))
    out["CUDA runtime"] = RUNTIME_GIB * t.GIB
    return out


@dataclass(frozen=True)
class EngineTerms:
    terms: dict[str, float]  # one of its GPUs while it generates
    idle: dict[str, float]  # what stays on the GPU while it is released (colocate)
    kv_tokens: float  # tokens its KV cache holds per server


def engine_terms(shape: ModelShape, layout: EngineLayout, gpu_bytes: float) -> EngineTerms:
    """One engine GPU: weights / TP, the KV cache (SGLang: what its static fraction leaves after the weights),
    and the runtime it keeps outside the pool."""
    weights = t.frozen_weights(shape, layout.weight_bytes, layout.tensor_parallel)
    per_token = t.kv_bytes_per_token(shape, layout.weight_bytes, layout.tensor_parallel)
    if layout.static_fraction is not None:
        kv = max(0.0, layout.static_fraction * gpu_bytes - weights)
        if layout.kv_cap_tokens:
            kv = min(kv, layout.kv_cap_tokens * per_token)
    else:
        kv = layout.kv_tokens * per_token
    runtime = layout.runtime_gib * t.GIB
    terms = {
        "engine weights": weights,
        "engine KV cache": kv,
        "engine runtime (graphs, activations)": runtime,
    }
    idle = {"engine runtime (released)": runtime} if layout.releases_memory else dict(terms)
    return EngineTerms(terms, idle, kv / per_token if per_token else 0.0)
