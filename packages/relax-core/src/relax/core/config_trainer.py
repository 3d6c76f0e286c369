"""The ``trainer`` section of the run config: optimisation, micro-batching and real-length settings
(``TrainerConfig``), LoRA (``LoraConfig``) and the checks LoRA needs on its own. ``relax.core.config``
re-exports both classes; the backend's own fields live in ``trainer.backend_params``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class LoraConfig:
    """``trainer.lora``: train low-rank adapters (``peft``) on a frozen base; weight syncs move only the
    adapter (docs/lora.md). ``target_modules``: module name suffixes (``q_proj``), or ``[all-linear]``."""

    rank: int = 16
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = field(default_factory=list)  # trained in full (and synced in full)
    export_merged: bool = False  # final export: also the base with the adapter merged (plain HF weights)


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = "torch"  # registered trainer name
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    micro_batch_size: int = 16
    num_minibatches: int = 1
    # real lengths (docs/long-sequences.md); 0: micro_batch_size rows, N: at most N tokens (every pass)
    max_tokens_per_micro_batch: int = 0
    pack_sequences: bool = False  # a micro-batch's rows as one sequence, no padding (attention stays per row)
    logits_chunk_tokens: int = 1024  # logprobs/entropy over this many tokens at a time (0: all at once)
    recompute: Literal["off", "full", "selective"] = "off"  # activation recompute (selective: megatron only)
    # False: use the engine's rollout logprobs as the PPO "old" policy (skips one forward pass)
    recompute_old_logprobs: bool = True
    # a non-finite loss or gradient stops the run naming the step; true: skip that update instead
    # (counted as train/skipped_nonfinite)
    skip_nonfinite: bool = False
    timeout_s: float = 600.0  # longest a train step, forward pass, save or load may take
    # a dead trainer restarts the run from its latest checkpoint up to this many times (0: the run fails)
    max_restarts: int = 0
    # colocate: parameters and optimizer state go to host memory between updates (engines get the GPU; docs/modes.md)
    offload: bool = False
    backend_params: Any = field(default_factory=dict)  # typed by the backend's registered config
    lora: LoraConfig | None = None  # null: train every weight


def lora_errors(cfg: Any) -> list[str]:
    """``trainer.lora`` on its own (backends and engines without LoRA refuse it in their ``validate_run``)."""
    lora = cfg.trainer.lora
    if lora is None:
        return []
    errors = [
        f"trainer.lora.{name}: must be > 0, got {value}"
        for name, value in (("rank", lora.rank), ("alpha", lora.alpha))
        if value <= 0
    ]
    if not 0 <= lora.dropout < 1:
        errors.append(f"trainer.lora.dropout: must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules:
        errors.append(
            "trainer.lora.target_modules: name at least one module (e.g. [q_proj, v_proj] or [all-linear])"
        )
    return errors


def offload_errors(cfg: Any) -> list[str]:
    """``trainer.offload`` where it means nothing: outside colocate the trainer has its GPUs to itself, and an
    engine hosted on the trainer's own model would lose its weights with it (``controller.hosting.placement_errors``
    refuses that). A backend that cannot offload refuses it in its ``validate_run``."""
    if not cfg.trainer.offload:
        return []
    if cfg.mode != "colocate":
        return [
            f"trainer.offload: supported in mode 'colocate' only (in mode {cfg.mode!r} the trainer has its GPUs "
            "to itself: nothing would use the memory it frees); set it to false"
        ]
    return []
