"""One rank of a megatron trainer, built: its place in the TP x CP x PP x DP (x EP) world (:func:`join_world`), the
model loaded from the HF checkpoint with its media front (:func:`build_model`), and the optimizer over it
(:func:`build_optimizer`). ``MegatronTrainer``'s constructor is these three calls; each is a seam a test
or another trainer can use alone.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from relax.core.policy_update import UpdateSettings
from relax.core.trainers.policy_trainer import adamw_from
from relax.megatron import convert, gpt_model, media_front
from relax.megatron.host_memory import built_unfilled
from relax.megatron.parallel import ensure_process_group, initialize_model_parallel, model_overrides
from relax.megatron.rank_load import load_rank, no_init

TOWER = "front."  # grad_params name prefix of a media tower weight (media_front.py)


@dataclass(frozen=True)
class Ranks:
    """This rank's sizes, ranks and process groups in megatron's world. DP is megatron's (world / (TP x
    CP x PP)): each replica takes its share of every batch's rows. EP: each rank holds experts / EP experts;
    their gradients are summed over the expert-DP ranks only. CP (context_parallel.py): the CP ranks of a
    replica hold its rows, each two chunks of every sequence; gradients are summed over ``dp_cp_group``."""

    tp: int
    tp_rank: int
    tp_group: Any
    pp: int
    pp_rank: int
    dp: int
    dp_rank: int
    dp_group: Any
    ep: int
    ep_rank: int
    ep_group: Any
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    dp_cp_group: Any = None  # DP x CP: what gradients are summed over (the DP group itself at CP 1)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def attributes(self) -> dict[str, Any]:
        """Every field and the two stage flags, by name: a trainer's attributes (``trainer.tp`` ...)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "first_stage": self.first_stage, "last_stage": self.last_stage}


def check_precision(dtype: str, distributed_optimizer: bool, device: torch.device) -> None:
    """The dtypes this trainer runs (bf16 on CPU runs here, for the tests; the plugin refuses it) and the
    distributed optimizer's device."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: the megatron trainer runs float32 or bfloat16")
    if distributed_optimizer and device.type != "cuda":
        from relax.megatron.distopt import CPU_REASON

        raise ValueError(CPU_REASON)


def split_media_config(hf_config: Any) -> tuple[Any, Any]:
    """(a media model's whole HF config or None, the language model's config); a whole Qwen-Omni
    checkpoint's ``hf_config`` is its thinker's already (``model_config``)."""
    if media_front.is_media_model(hf_config):
        return hf_config, media_front.lm_config(hf_config)
    return None, hf_config


def join_world(
    rank: int,
    world_size: int,
    master_addr: str | None,
    master_port: int | None,
    layout: tuple[int, int, int, int],
    seed: int,
    device: torch.device,
    timeout_s: float,
    context_parallel: int = 1,
) -> Ranks:
    """Join the default process group (gloo on CPU, NCCL on CUDA) and megatron's parallel state of
    ``layout`` (TP, PP, DP, EP) and ``context_parallel`` (world = TP x CP x PP x DP)."""
    from megatron.core import parallel_state as ps

    tp, pp, dp, ep = layout
    cp = context_parallel
    backend = "nccl" if device.type == "cuda" else "gloo"
    ensure_process_group(rank, world_size, master_addr, master_port, timeout_s=timeout_s, backend=backend)
    initialize_model_parallel(tp, pp, seed=seed, expert_parallel=ep, timeout_s=timeout_s, context_parallel=cp)
    return Ranks(
        tp=tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp=pp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp=dp,
        dp_rank=ps.get_data_parallel_rank(),
        dp_group=ps.get_data_parallel_group(),
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        cp=cp,
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    )


def build_model(
    model_path: str,
    hf_config: Any,
    media_config: Any,
    ranks: Ranks,
    *,
    layer_spec: str,
    device: torch.device,
    dtype: torch.dtype,
    trainable: bool,
    per_token_loss: bool,
    sequence_parallel: bool,
    recompute: str,
    freeze: dict[str, bool],
) -> tuple[Any, media_front.MediaFront | None]:
    """(this stage's GPTModel, the media front or None) in eval mode, loaded with this rank's part of
    the checkpoint, on ``device``. A media model (``media_config``: its whole HF config, ``hf_config`` its
    LM's) gets HF's towers, scatter and rope index feeding megatron's LM (media_front.py); frozen towers
    are neither trained nor exported (the rollout engine loaded them already), as in core: ``freeze``
    maps ``media_towers`` / ``vision`` / ``audio`` to the trainer's ``freeze_<kind>`` switches."""
    layout = model_overrides(
        ranks.pp,
        ranks.ep,
        dtype,
        per_token_loss=per_token_loss,  # megatron's DDP (distributed optimizer) then sums gradients over DP
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        context_parallel=ranks.cp,
    )
    build = functools.partial(  # on CPU built unfilled (host_memory.py): the load fills it
        gpt_model.build_gpt_model,
        hf_config,
        pre_process=ranks.first_stage,
        post_process=ranks.last_stage,
        layer_spec=layer_spec,
        tensor_model_parallel_size=ranks.tp,
        use_cpu_initialization=device.type == "cpu",
        init_method=no_init,
        output_layer_init_method=no_init,
        **layout,
    )
    # not at PP > 1 with a tied embedding: megatron's build all-reduces it between the first and last stage
    unfilled = device.type == "cpu" and not (ranks.pp > 1 and hf_config.tie_word_embeddings)
    model = built_unfilled(build) if unfilled else build()
    front = None
    if media_config is not None:
        front = media_front.MediaFront(model_path, model, media_config, first_stage=ranks.first_stage)
    source = front.take_lm_weights() if front is not None else model_path  # a dict: loaded whole
    load = convert.load_hf_into if isinstance(source, dict) else load_rank  # load_rank: this rank's part only
    load(model, source, hf_config, ranks.tp, ranks.tp_rank, ranks.pp, ranks.pp_rank, ranks.ep, ranks.ep_rank)
    model.to(device)  # a no-op where megatron already allocated on the current GPU
    model.eval()  # no dropout: training and scoring forwards agree
    model.requires_grad_(trainable)
    if front is not None:
        front.to(device).eval()
        front.cast_parameters(dtype)  # bf16: the towers too (their fp32 masters in build_optimizer)
        front.requires_grad_(trainable)
    switches = {f"freeze_{kind}": on for kind, on in freeze.items()}
    media_front.freeze(front, media_config or hf_config, **switches)
    return model, front


def build_optimizer(
    model: Any,
    front: media_front.MediaFront | None,
    s: UpdateSettings,
    dtype: torch.dtype,
    *,
    trainable: bool,
    distributed: bool,
) -> tuple[Any, Any, Any, list[tuple[str, torch.nn.Parameter]]]:
    """(megatron's DDP wrapper or None, the optimizer or None, fp32 masters or None, grad_params).

    ``grad_params``: what the gradient code reduces and clips, by parameter name: the model's parameters
    (and a media model's trained towers, replicated per TP rank), or their masters. ``distributed``:
    megatron's DDP and DistributedOptimizer (distopt.py); else AdamW, over fp32 masters in bf16
    (precision.py); a frozen model gets none."""
    grad_params: list[tuple[str, torch.nn.Parameter]] = list(model.named_parameters())
    if front is not None and trainable:  # HF-named tower weights, replicated per TP rank
        grad_params += [(TOWER + n, p) for n, p in front.tower_parameters(frozen=False)]
    if distributed:
        from relax.megatron import distopt

        bf16 = dtype == torch.bfloat16
        kwargs = dict(lr=s.lr, min_lr=s.lr * s.min_lr_ratio, weight_decay=s.weight_decay, bf16=bf16)
        ddp, optimizer = distopt.wrap(model, betas=s.betas, eps=s.eps, **kwargs)
        return ddp, optimizer, None, grad_params
    if not trainable:
        return None, None, None, grad_params
    masters = None
    if dtype != torch.float32:
        from relax.megatron.precision import MasterWeights

        masters = MasterWeights(grad_params)  # the towers' included
        grad_params = masters.named()
    return None, adamw_from([p for _, p in grad_params], s), masters, grad_params
