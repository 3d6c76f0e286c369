"""Entry point of relax-megatron: registers the ``megatron`` trainer with relax-core."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax.core.context import PluginContext, Resources
from relax.core.hookspecs import hookimpl


@dataclass(frozen=True)
class MegatronParams:
    """``trainer.backend_params`` of the ``megatron`` trainer."""

    tensor_parallel: int = 1  # TP ranks: one rank actor each (a worker group), gloo on CPU
    pipeline_parallel: int = 1  # PP stages (1F1B): one rank actor each
    # data-parallel replicas (megatron's world = TP x CP x PP x DP rank actors); each takes its share of the rows
    data_parallel: int = 1
    # MoE expert-parallel ranks, carved from the TP x CP x DP ones (must divide their product)
    expert_parallel: int = 1
    # ranks per sequence: each holds 2 of its 2 x CP chunks (context_parallel.py); needs device cuda and
    # layer_spec te (Transformer Engine's attention); not yet run on a GPU in this repo (docs/long-sequences.md)
    context_parallel: int = 1
    # split the activations outside attention / MLP along the sequence over the TP ranks (needs
    # tensor_parallel > 1 and pipeline_parallel 1); always on for an MoE model at tensor_parallel > 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # megatron's DistributedOptimizer, sharded over DP: device cuda only
    num_cpus: float = 1.0  # reserved per rank
    # cpu (gloo, float32), or cuda / cuda:N: each rank actor reserves one GPU and uses NCCL (not yet run
    # on a device in this repo: see docs/megatron.md)
    device: str = "cpu"
    # None: the run's dtype; bfloat16 needs device cuda (bf16 parameters, fp32 master weights, grads and Adam state)
    dtype: Literal["float32", "bfloat16"] | None = None
    # megatron layer spec: auto = Transformer Engine's (fused kernels, flash attention) when
    # transformer_engine imports on a CUDA device (built for your torch: docs/gpu.md), else local (plain torch)
    layer_spec: Literal["auto", "te", "local"] = "auto"
    # longest any collective of the trainer's process groups may wait (None: trainer.timeout_s); a save_hf
    # gathers the whole model on every rank while rank 0 writes it
    timeout_s: float | None = None
    # media models (Qwen-VL, Qwen-Omni): keep the towers' weights as loaded (not trained, not synced): every
    # tower (a model without towers is no error), or the vision / audio one only (a model without it is an error)
    freeze_media_towers: bool = False
    freeze_vision: bool = False
    freeze_audio: bool = False

    def validate(self) -> list[str]:
        errors = [
            f"{name}: must be >= 1, got {value}"
            for name, value in (
                ("tensor_parallel", self.tensor_parallel),
                ("pipeline_parallel", self.pipeline_parallel),
                ("data_parallel", self.data_parallel),
                ("expert_parallel", self.expert_parallel),
                ("context_parallel", self.context_parallel),
            )
            if value < 1
        ]
        if errors:
            return errors
        if self.device != "cpu" and not self.device.startswith("cuda"):
            errors.append(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype == "bfloat16" and not self.device.startswith("cuda"):
            errors.append("dtype: bfloat16 needs device: cuda; on CPU the megatron trainer runs float32 only")
        if self.context_parallel > 1 and (self.layer_spec != "te" or not self.device.startswith("cuda")):
            from relax.megatron.context_parallel import TE_REASON

            errors.append(f"context_parallel: {TE_REASON}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            errors.append(
                "sequence_parallel: needs tensor_parallel > 1 (it splits the sequence over the TP ranks)"
            )
        if self.layer_spec == "te" and not self.device.startswith("cuda"):
            errors.append("layer_spec: te needs device: cuda (Transformer Engine has no CPU kernels)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            errors.append(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.distributed_optimizer and not self.device.startswith("cuda"):
            from relax.megatron.distopt import CPU_REASON

            errors.append(CPU_REASON)
        carved = self.tensor_parallel * self.context_parallel * self.data_parallel
        if carved % self.expert_parallel:
            cp = "context_parallel x " if self.context_parallel > 1 else ""
            errors.append(
                f"expert_parallel={self.expert_parallel}: must divide tensor_parallel x {cp}data_parallel="
                f"{carved} (expert-parallel ranks are carved from those, "
                "as in megatron with expert tensor parallelism 1)"
            )
        return errors

    def memory_layout(self, cfg: Any) -> Any:
        """The memory plan's view of this trainer (``relax.core.memory_plan``); None on CPU. Flash attention only
        with ``layer_spec: te``: ``auto`` is counted as the local spec, which materialises every S x S score
        (whether Transformer Engine imports depends on the machine; the plan must not)."""
        if not self.device.startswith("cuda"):
            return None
        from relax.core.memory_plan import model_parallel

        dtype = self.dtype or cfg.model.dtype
        tp, pp, dp, ep = (
            self.tensor_parallel,
            self.pipeline_parallel,
            self.data_parallel,
            self.expert_parallel,
        )
        cp = self.context_parallel
        note = f"megatron TP {tp}" + (f" x CP {cp}" if cp > 1 else "") + f" x PP {pp} x DP {dp}"
        note += (f" x EP {ep}" if ep > 1 else "") + f", {dtype}"
        note += ", distributed optimizer" if self.distributed_optimizer else ""
        note += (
            "" if self.layer_spec == "te" else f", layer_spec {self.layer_spec}: unfused attention counted"
        )
        layout = model_parallel(
            tp,
            pp,
            dp * cp,  # the world's data x context ranks: the distributed optimizer shards over both
            ep,
            dtype,
            distributed_optimizer=self.distributed_optimizer,
            sequence_parallel=self.sequence_parallel,
            flash_attention=self.layer_spec == "te",
            chunked_logits=True,
            note=note,
        )
        return dataclasses.replace(layout, context_parallel=cp) if cp > 1 else layout

    def validate_run(self, cfg: Any) -> list[str]:
        """Checks against the whole run (core's ``validate_run``): what this trainer cannot do yet."""
        errors = [LORA_MISSING] if getattr(cfg.trainer, "lora", None) is not None else []
        if cfg.algorithm.critic.enable:  # what megatron_trainer refuses at start-up, caught by relax validate
            errors.append(CRITIC_MISSING)
        if cfg.trainer.pack_sequences:
            errors.append(
                "trainer.pack_sequences: the megatron trainer does not pack rows yet (megatron's THD "
                "layout needs Transformer Engine); use trainer.max_tokens_per_micro_batch, which sizes "
                "and trims its micro-batches, or trainer.backend torch / fsdp for packing"
            )
        if cfg.trainer.offload and self.distributed_optimizer:
            from relax.megatron.distopt import OFFLOAD_REASON

            errors.append(OFFLOAD_REASON)
        from relax.megatron.family_check import family_problems

        errors += family_problems(cfg.model.path)
        from relax.megatron.context_parallel import cp_run_problems

        errors += cp_run_problems(self.context_parallel, cfg)
        if cfg.trainer.max_tokens_per_micro_batch and self.pipeline_parallel > 1:
            errors.append(
                "trainer.max_tokens_per_micro_batch: megatron's pipeline schedule needs micro-batches "
                "of one shape; with pipeline_parallel > 1 use trainer.micro_batch_size"
            )
        return errors


#: why ``trainer.lora`` is refused on this trainer
LORA_MISSING = (
    "trainer.lora: not supported by trainer.backend megatron yet: megatron-core 0.16 has no LoRA layers of its "
    "own (NeMo's PEFT wraps them outside megatron-core), and relax-megatron has neither adapter modules in its "
    "layer specs nor an adapter-only export; use trainer.backend torch for LoRA, or trainer.lora: null"
)


#: why ``algorithm.critic.enable`` is refused on this trainer
CRITIC_MISSING = (
    "algorithm.critic.enable: the megatron trainer has no critic (forward_values) yet; use "
    "trainer.backend torch or fsdp for PPO with a critic (both train it data-parallel)"
)


def world_size(params: MegatronParams) -> int:
    """Rank actors of the trainer's worker group: TP x CP x PP x DP (megatron's world size)."""
    return params.tensor_parallel * params.context_parallel * params.pipeline_parallel * params.data_parallel


def megatron_trainer(params: MegatronParams, ctx: PluginContext):
    """The factory: core's optimisation settings (``ctx.train``) and the algorithm's policy objective."""
    from relax.core.trainers.policy_trainer import loop_inputs
    from relax.megatron.trainer import MegatronTrainer

    errors = params.validate()
    if errors:
        raise ValueError("trainer.backend_params: " + "; ".join(errors))
    spec = ctx.train
    if spec.algorithm.critic.enable and spec.trainable:
        raise ValueError(CRITIC_MISSING)
    dtype = params.dtype or ctx.dtype
    if dtype != "float32" and not params.device.startswith("cuda"):  # bf16 on CPU: tests only, slow
        raise ValueError(
            f"dtype={dtype!r}: the megatron trainer runs float32 on CPU, and float32 or bfloat16 "
            "with trainer.backend_params.device: cuda"
        )
    settings, objective = loop_inputs(ctx)
    return MegatronTrainer(
        ctx.model_path,
        settings,
        objective=objective,
        trainable=spec.trainable,
        # frozen roles (reference, teacher) are one process: the whole model at TP=1
        tensor_parallel=params.tensor_parallel if spec.trainable else 1,
        pipeline_parallel=params.pipeline_parallel if spec.trainable else 1,
        data_parallel=params.data_parallel if spec.trainable else 1,
        expert_parallel=params.expert_parallel if spec.trainable else 1,
        context_parallel=params.context_parallel if spec.trainable else 1,
        rank=ctx.index,
        world_size=ctx.world_size,
        master_addr=ctx.master_addr,
        master_port=ctx.master_port,
        device=params.device,
        dtype=dtype,
        distributed_optimizer=params.distributed_optimizer,
        timeout_s=params.timeout_s or spec.optim.timeout_s,
        layer_spec=params.layer_spec,
        sequence_parallel=params.sequence_parallel and spec.trainable,
        freeze_media_towers=params.freeze_media_towers,
        freeze_vision=params.freeze_vision,
        freeze_audio=params.freeze_audio,
    )


@hookimpl
def relax_register_trainers(register):
    register(
        "megatron",
        megatron_trainer,
        config=MegatronParams,
        # one GPU per rank actor with device cuda (Ray sets each actor's CUDA_VISIBLE_DEVICES)
        resources=lambda p: Resources(
            p.num_cpus, 1.0 if p.device.startswith("cuda") else 0.0, num_workers=world_size(p)
        ),
    )


def _to_hf(checkpoint: str, hf_dir: str) -> int:
    """``relax convert <megatron_ckpt> <hf_dir>``: a megatron dist checkpoint -> an HF directory."""
    from relax.megatron.checkpoint import to_hf

    return len(to_hf(checkpoint, hf_dir))


def _is_megatron_checkpoint(path) -> bool:
    from relax.megatron.checkpoint import HF_DIR

    return (Path(path) / "metadata.json").is_file() and (Path(path) / HF_DIR / "config.json").is_file()


@hookimpl
def relax_register_checkpoint_formats(register):
    register("megatron", _to_hf, detect=_is_megatron_checkpoint)
