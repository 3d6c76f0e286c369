"""``MegatronTrainer``: relax's ``Trainer`` protocol on a megatron-core GPTModel (this rank's shard).

The model is built from the HF config and loaded from the HF safetensors through
:mod:`relax.megatron.convert`; logprobs and entropy are computed vocab-parallel
(:mod:`relax.megatron.logprobs`); the loss is core's policy objective with step-global token counts,
as in core's torch trainer, so the two give the same loss on the same batch. One process per rank of
megatron's TP x PP x DP world (gloo on CPU; NCCL and ``cuda:<local rank>`` with ``device="cuda"``:
batches go to the device, scores come back on CPU, exported weights stay on the device); every rank is
called with the whole batch, together (``export_weights`` gathers across TP, PP and EP, so it is
collective too: ``collective_export``, core's worker group has every rank export in step and sends rank
0's buckets). DP replicas take their share of the rows; token counts, loss sums and gradients are
summed over them (step-global normalisation). ``train_step`` is core's policy-update loop
(:class:`~relax.core.policy_update.PolicyUpdate`); this class is its model step
(:class:`~relax.core.policy_update.ModelStep`), with megatron's 1F1B schedule under PP.

Precision: float32, or bfloat16 parameters with fp32 master weights, fp32 gradient accumulation and
reduction and fp32 Adam state (:mod:`relax.megatron.precision`; megatron's DistributedOptimizer does the
same with ``distributed_optimizer``). Attention: right-padded rows and megatron's causal mask type, no
dense mask (:mod:`relax.megatron.padding`); the layer spec is Transformer Engine's when it is installed
(:mod:`relax.megatron.layer_specs`). MoE routing replay: a batch's ``routed_experts`` go to the routers
of every forward when the settings say so (:mod:`relax.megatron.routing`). Sequence parallelism (asked for,
or by itself for an MoE model at TP > 1, which megatron's MoE layer needs): the sequence is padded to a
multiple of TP and split over the TP ranks outside attention and the MLPs; the norms' and routers' gradients
are summed over TP, the experts' (whole on each TP rank) over the expert-data-parallel group. Context
parallelism (:mod:`relax.megatron.context_parallel`; Transformer Engine only, not yet run on a GPU): each CP rank
runs two of every row's 2 x CP chunks, the scores are gathered over CP and gradients summed over DP x CP.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from relax.core.multimodal_model import model_config
from relax.core.policy_update import LossFn, Objective, PolicyUpdate, UpdateSettings
from relax.core.trainers.export import NamedTensors, buckets
from relax.core.trainers.offload import Offloadable
from relax.core.trainers.policy_trainer import PolicyTrainer, seeded
from relax.megatron import convert, grads, media_front
from relax.megatron.build import build_model, build_optimizer, check_precision, join_world, split_media_config
from relax.megatron.chunked import OutputPassthrough
from relax.megatron.context_parallel import TE_REASON, sequence_multiple
from relax.megatron.forward import MegatronForward
from relax.megatron.grads import is_expert
from relax.megatron.logprobs import logprobs_and_entropy
from relax.megatron.parallel import (
    DEFAULT_TIMEOUT_S,
    check_layout,
    gather_tp_shards,
    rank_device,
    rank_rows,
    recomputing,
    sequence_parallel_on,
)
from relax.megatron.pipeline import from_last_stage, global_layer_names, run_schedule, stage_units
from relax.megatron.rank_load import save_streamed
from relax.megatron.routing import MegatronRouting, routing_metrics


class MegatronTrainer(MegatronForward, PolicyTrainer, Offloadable):
    """One rank of a megatron-core trainer. ``trainable=False`` is a frozen reference (no optimizer). The
    scoring path is :class:`~relax.megatron.forward.MegatronForward`'s; the building, ``relax.megatron.build``'s."""

    collective_export = True  # export_weights all-gathers the TP shards: every rank iterates it together

    def __init__(
        self,
        model_path: str,
        settings: UpdateSettings | None = None,
        *,
        objective: Objective | None = None,
        trainable: bool = True,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        data_parallel: int = 1,
        expert_parallel: int = 1,
        context_parallel: int = 1,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        distributed_optimizer: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        layer_spec: str = "auto",
        sequence_parallel: bool = False,
        freeze_media_towers: bool = False,
        freeze_vision: bool = False,
        freeze_audio: bool = False,
        **overrides: Any,
    ) -> None:
        from relax.megatron.layer_specs import resolve_layer_spec

        self.settings = s = seeded(settings, overrides)
        check_layout(
            world_size, tensor_parallel, pipeline_parallel, data_parallel, expert_parallel, context_parallel
        )
        self.model_path, self.timeout_s = model_path, timeout_s
        # a media model (media_front.py): ``media_config`` its whole HF config, ``hf_config`` its LM's
        self.media_config, self.hf_config = split_media_config(model_config(model_path))
        moe = bool(convert.Dims.from_hf(self.hf_config).experts)
        self.sequence_parallel = sequence_parallel_on(sequence_parallel, tensor_parallel, moe)
        # what the stages pad to: TP under sequence parallelism, 2 x CP chunks (context_parallel.py)
        self.seq_multiple = sequence_multiple(tensor_parallel, self.sequence_parallel, context_parallel)
        self.device = rank_device(device, rank)
        check_precision(dtype, distributed_optimizer and trainable, self.device)
        self.layer_spec = resolve_layer_spec(layer_spec, self.device.type)
        if context_parallel > 1 and (self.layer_spec != "te" or self.media_config is not None):
            raise ValueError(
                TE_REASON if self.layer_spec != "te" else "context_parallel > 1: text models only"
            )
        if self.device.type == "cuda":  # before megatron builds anything: it allocates on the current device
            torch.cuda.set_device(self.device)
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.distributed_optimizer = distributed_optimizer and trainable
        layout = (tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        ranks = join_world(
            rank,
            world_size,
            master_addr,
            master_port,
            layout,
            s.seed,
            self.device,
            timeout_s,
            context_parallel,
        )
        vars(self).update(ranks.attributes())  # self.tp, tp_rank, tp_group, ..., first_stage, last_stage
        if self.media_config is not None:
            media_front.check_supported(self.media_config, self.distributed_optimizer)
        self.model, self.front = build_model(
            model_path,
            self.hf_config,
            self.media_config,
            ranks,
            layer_spec=self.layer_spec,
            device=self.device,
            dtype=self.dtype,
            trainable=trainable,
            per_token_loss=self.distributed_optimizer,
            sequence_parallel=self.sequence_parallel,
            recompute=s.recompute if trainable else "off",
            freeze=dict(media_towers=freeze_media_towers, vision=freeze_vision, audio=freeze_audio),
        )
        # ddp: megatron's wrapper (distributed optimizer only); masters: bf16 without it (precision.py)
        self.ddp, self.optimizer, self.masters, self.grad_params = build_optimizer(
            self.model, self.front, s, self.dtype, trainable=trainable, distributed=self.distributed_optimizer
        )
        # chunked scores (chunked.py): the last stage's forward returns hidden states, scored a chunk at a time
        self.head = None
        if self.last_stage and s.logits_chunk_tokens > 0:
            self.head = OutputPassthrough(self.model, self.tp_group, self.tp, self.sequence_parallel)
        # MoE routing replay: a batch's ``routed_experts`` fed to this stage's routers (routing.py); None: dense
        self.routing = MegatronRouting.for_model(
            self.model, s.routing_replay, self.hf_config.num_hidden_layers
        )
        if self.routing is not None and self.cp > 1:
            raise ValueError(
                "algorithm.routing_replay with context_parallel > 1: routes are not split over CP"
            )
        if self.routing is not None and self.sequence_parallel:  # each TP rank routes its sequence slice
            self.routing.sequence_split = (self.tp, self.tp_rank)
        # core's loop; its ``step`` (train_step calls) is what a checkpoint stores
        self.update = PolicyUpdate(self, s, objective if trainable else None, fuse_old_logprobs=False)

    @property
    def dp_size(self) -> int:
        return self.dp

    @staticmethod
    def fuses_old_logprobs() -> bool:
        """Old logprobs come from a separate forward (the controller's, or the loop's before any update)."""
        return False

    def offloaded_parts(self) -> tuple[list[Any], list[Any], list[torch.nn.Parameter]]:
        """``trainer.offload`` (core's ``Offloadable``): the model and its media towers, the fp32 masters and the
        AdamW state. Not with the distributed optimizer (``distopt.OFFLOAD_REASON``)."""
        if self.ddp is not None:
            from relax.megatron.distopt import OFFLOAD_REASON

            raise RuntimeError(OFFLOAD_REASON)
        masters = self.masters.masters if self.masters is not None else []
        return [self.model, self.front], [self.optimizer], masters

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(
            "the megatron trainer has no critic yet: use trainer.backend torch or fsdp with algorithm.critic"
        )

    # ----------------------------------------------------------------- training
    def step_metrics(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """``train_step`` (``PolicyTrainer``'s: core's loop, ``num_minibatches`` optimizer steps): with
        ``routed_experts`` on an MoE model, core's ``routing/*`` metrics before the update (routing.py)."""
        return routing_metrics(
            self.routing,
            batch,
            self.settings.micro_batch_size,
            score=lambda sub: self._masked_scores(sub, logprobs_and_entropy, 1)[0],
            device=self.device,
        )

    # ------------------------------------------------------- ModelStep (the loop's calls)
    def local_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's rows, padded to the same count on every replica (``parallel.rank_rows``)."""
        return rank_rows(batch, self.dp, self.dp_rank)

    def forward_backward(
        self, micro_batches: Sequence[dict[str, torch.Tensor]], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        """Per micro-batch: forward, vocab-parallel logprobs and entropy, ``loss_fn``, backward; under PP
        megatron's 1F1B schedule runs them (the last stage calls ``loss_fn``; its records go to every stage)."""

        def finish(
            sub: dict[str, torch.Tensor], logits: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, float]]:
            return loss_fn(sub, *self._scores(sub, logits))

        with recomputing(self.model, self.settings.recompute):  # megatron recomputes in training mode only
            if self.pp == 1:
                records = []
                for sub in micro_batches:
                    loss, record = finish(sub, self._forward(self.model, sub))
                    loss.backward()
                    records.append(record)
                return records
            return from_last_stage(
                [],
                run_schedule(
                    self.model,
                    micro_batches,
                    self._forward,
                    finish,
                    forward_only=False,
                    seq_multiple=self.seq_multiple,
                ),
            )[1]

    def finish_gradients(self, max_norm: float) -> float:
        if (
            self.ddp is not None
        ):  # megatron's DDP: its finalize_model_grads does the sums below; clips in apply
            from relax.megatron import distopt

            return distopt.reduce_grads(self.ddp, self.optimizer)
        grads.sum_tensor_parallel_replica_grads(self.grad_params, self.tp, self.tp_group)
        if self.pp > 1 and self.hf_config.tie_word_embeddings:
            grads.sum_tied_embedding_grads(self.model, self.masters)
        # DP x CP: each CP rank back-propagated its own tokens' share of the replica's loss
        grads.sum_data_parallel_grads(self.grad_params, self.dp * self.cp, self.dp_cp_group)
        simple = self.tp == self.pp == self.ep == 1
        return grads.clip_grad_norm(self.grad_params, max_norm, self.device, simple=simple)

    def apply_gradients(self, lr: float) -> str | None:
        """The optimizer step (the weights are not checked afterwards: None); bf16: the fp32 masters
        step, then the model takes their values."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.ddp is not None:
            from relax.megatron import distopt

            distopt.apply(self.optimizer, self.settings.grad_clip)
        else:
            self.optimizer.step()
            if self.masters is not None:
                self.masters.copy_to_model()
        return None

    def zero_grad(self) -> None:
        if self.ddp is not None:
            from relax.megatron import distopt

            distopt.zero_grads(self.ddp, self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the data-parallel replicas (fp64, one collective); DP=1: ``values``."""
        if self.dp == 1:
            return values
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        torch.distributed.all_reduce(summed, group=self.dp_group)
        return summed.tolist()

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[NamedTensors]:
        """HF-named, TP- and PP-gathered weights in buckets of about ``bucket_bytes`` (tied embeddings
        once), streamed: one decoder layer (or top-level weight) is gathered and converted at a time.

        The tensors are on the trainer's device, in the model's dtype: ``cuda:<rank>`` with
        ``device: cuda`` (what an NCCL sender or a CUDA-IPC handle needs; a transport that ships bytes
        moves them to the host itself), CPU on CPU. They may be views of the live weights: a receiver
        copies a bucket before the next train step."""
        from relax.megatron.layer_specs import from_te_names

        local = convert.weights_only(self.model.state_dict())
        if self.layer_spec == "te":  # the mapping speaks the local spec's names
            local = from_te_names(local)
        if self.pp > 1:  # whole-model layer numbers; the last stage's copy of a tied embedding left out
            offset = convert.stage_layers(self.hf_config.num_hidden_layers, self.pp, self.pp_rank).start
            tied_copy = (
                ("output_layer.weight",)
                if self.hf_config.tie_word_embeddings and not self.first_stage
                else ()
            )
            local = global_layer_names(local, offset, tied_copy)
        units = convert.export_units(list(local))

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            if self.pp > 1:
                source = stage_units(units, local)
            else:
                source = ({n: local[n].detach() for n in unit} for unit in units)
            # a unit's shards: the TP ranks' and, for experts, the EP ranks' (each holds its experts whole)
            for unit in source:
                experts = {n: t for n, t in unit.items() if is_expert(n)}
                shards = gather_tp_shards(
                    {n: t for n, t in unit.items() if n not in experts}, self.tp, self.tp_group
                )
                expert_shards = gather_tp_shards(experts, self.ep, self.ep_group) if experts else []
                for name, tensor in convert.megatron_to_hf(
                    shards, self.hf_config, partial=True, expert_shards=expert_shards
                ).items():
                    yield media_front.hf_name(name, self.front and self.front.hooks.lm_prefix), tensor
            if self.front is not None:  # replicated: every rank holds them whole
                yield from ((n, p.detach()) for n, p in self.front.tower_parameters(frozen=False))

        yield from buckets(named(), bucket_bytes)

    def save_hf(self, directory: str) -> None:
        """An HF directory (config, tokenizer, safetensors) that plain transformers loads. Collective:
        streamed (``rank_load.save_streamed``), no rank holds the whole model in host memory."""
        towers = self.front.tower_parameters(frozen=True) if self.front is not None else ()
        save_streamed(
            directory, self.export_weights(), towers, self.media_config or self.hf_config, self.model_path
        )

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: str) -> None:
        """A megatron dist checkpoint: model, optimizer, step and RNG (collective; see ``checkpoint``)."""
        from relax.megatron import checkpoint

        checkpoint.save(self, directory)

    def load(self, directory: str) -> None:
        """Resume from :meth:`save`'s directory, also one saved at another TP size."""
        from relax.megatron import checkpoint

        checkpoint.load(self, directory)
