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
are summed over TP, the experts' (whole on each TP rank) over the expert-data-parallel group.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from relax.core.multimodal_model import model_config
from relax.core.policy_update import LossFn, Objective, PolicyUpdate, UpdateSettings
from relax.core.policy_update.token_budget import in_row_order, micro_batches
from relax.core.trainers.export import NamedTensors, buckets
from relax.core.trainers.offload import Offloadable
from relax.megatron import convert, grads, media_front
from relax.megatron.chunked import OutputPassthrough, chunked_scores
from relax.megatron.grads import is_expert
from relax.megatron.logprobs import logprobs_and_entropy
from relax.megatron.padding import pad_to_multiple, response_logits, right_padded
from relax.megatron.parallel import (
    DEFAULT_TIMEOUT_S,
    check_layout,
    ensure_process_group,
    gather_rows,
    gather_tp_shards,
    initialize_model_parallel,
    model_overrides,
    rank_device,
    rank_rows,
    recomputing,
    sequence_parallel_on,
)
from relax.megatron.pipeline import from_last_stage, global_layer_names, run_schedule, stage_units
from relax.megatron.rank_load import load_rank, no_init, save_streamed
from relax.megatron.routing import MegatronRouting, routing_metrics

TOWER = "front."  # grad_params name prefix of a media tower weight (media_front.py)


class MegatronTrainer(Offloadable):
    """One rank of a megatron-core trainer. ``trainable=False`` is a frozen reference (no optimizer)."""

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
        from megatron.core import parallel_state
        from relax.megatron.layer_specs import resolve_layer_spec

        self.settings = s = (settings or UpdateSettings()).with_overrides(**overrides)
        check_layout(world_size, tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        hf_config = model_config(model_path)  # a whole Qwen-Omni checkpoint: its thinker's
        lm = media_front.lm_config(hf_config) if media_front.is_media_model(hf_config) else hf_config
        self.sequence_parallel = sequence_parallel_on(
            sequence_parallel, tensor_parallel, bool(convert.Dims.from_hf(lm).experts)
        )
        self.seq_multiple = (
            tensor_parallel if self.sequence_parallel else 1
        )  # the stages pad the sequence to it
        if dtype not in ("float32", "bfloat16"):  # bf16 on CPU runs here (the tests), the plugin refuses it
            raise ValueError(f"dtype={dtype!r}: the megatron trainer runs float32 or bfloat16")
        self.device = rank_device(device, rank)
        self.layer_spec = resolve_layer_spec(layer_spec, self.device.type)
        self.timeout_s = timeout_s
        if self.device.type == "cuda":  # before megatron builds anything: it allocates on the current device
            torch.cuda.set_device(self.device)
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.distributed_optimizer = distributed_optimizer and trainable
        if self.distributed_optimizer and self.device.type != "cuda":
            from relax.megatron.distopt import CPU_REASON

            raise ValueError(CPU_REASON)
        random.seed(s.seed)
        np.random.seed(s.seed)
        torch.manual_seed(s.seed)
        ensure_process_group(
            rank,
            world_size,
            master_addr,
            master_port,
            timeout_s=timeout_s,
            backend="nccl" if self.device.type == "cuda" else "gloo",
        )
        initialize_model_parallel(
            tensor_parallel,
            pipeline_parallel,
            seed=s.seed,
            expert_parallel=expert_parallel,
            timeout_s=timeout_s,
        )
        self.model_path = model_path
        self.hf_config = hf_config
        self.front = (
            None  # media models (media_front.py): HF's towers, scatter and rope index feeding megatron's LM
        )
        self.media_config = None  # a media model's whole HF config (``hf_config`` is then its LM's)
        if media_front.is_media_model(self.hf_config):
            media_front.check_supported(self.hf_config, self.distributed_optimizer)
            self.media_config, self.hf_config = self.hf_config, media_front.lm_config(self.hf_config)
        self.tp, self.tp_rank = tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp, self.pp_rank = pipeline_parallel, parallel_state.get_pipeline_model_parallel_rank()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pipeline_parallel - 1
        # DP (megatron derives it: world / (TP x PP)): each replica takes its share of every batch's rows
        self.dp, self.dp_rank = data_parallel, parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        # EP: each rank holds experts / EP experts; their gradients are summed over the expert-DP ranks only
        self.ep, self.ep_rank = expert_parallel, parallel_state.get_expert_model_parallel_rank()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        # megatron's DDP (distributed optimizer) then sums gradients over DP, as our own path does
        layout = model_overrides(
            pipeline_parallel,
            expert_parallel,
            self.dtype,
            per_token_loss=self.distributed_optimizer,
            sequence_parallel=self.sequence_parallel,
            recompute=self.settings.recompute if trainable else "off",
        )
        self.model = convert.build_gpt_model(
            self.hf_config,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            layer_spec=self.layer_spec,
            tensor_model_parallel_size=tensor_parallel,
            use_cpu_initialization=self.device.type == "cpu",
            init_method=no_init,
            output_layer_init_method=no_init,
            **layout,
        )
        if self.media_config is not None:
            self.front = media_front.MediaFront(
                model_path, self.model, self.media_config, first_stage=self.first_stage
            )
        source = (
            self.front.take_lm_weights() if self.front is not None else model_path
        )  # a dict: loaded whole
        load = (
            convert.load_hf_into if isinstance(source, dict) else load_rank
        )  # load_rank: this rank's part only
        load(
            self.model,
            source,
            self.hf_config,
            self.tp,
            self.tp_rank,
            pipeline_parallel,
            self.pp_rank,
            expert_parallel,
            self.ep_rank,
        )
        self.model.to(self.device)  # a no-op where megatron already allocated on the current GPU
        self.model.eval()  # no dropout: training and scoring forwards agree
        self.model.requires_grad_(trainable)
        if self.front is not None:
            self.front.to(self.device).eval()
            self.front.cast_parameters(self.dtype)  # bf16: the towers too (their fp32 masters below)
            self.front.requires_grad_(trainable)
        # frozen towers are neither trained nor exported (the rollout engine loaded them already), as in core
        media_front.freeze(
            self.front,
            self.media_config or self.hf_config,
            freeze_media_towers=freeze_media_towers,
            freeze_vision=freeze_vision,
            freeze_audio=freeze_audio,
        )
        self.ddp = None  # megatron's DDP wrapper: with the distributed optimizer only
        self.masters = None  # bf16 without it: fp32 master weights (precision.py)
        # what the gradient code reduces and clips, by parameter name: the model's parameters, or their masters
        self.grad_params: list[tuple[str, torch.nn.Parameter]] = list(self.model.named_parameters())
        if self.front is not None and trainable:  # HF-named tower weights, replicated per TP rank
            self.grad_params += [(TOWER + n, p) for n, p in self.front.tower_parameters(frozen=False)]
        if self.distributed_optimizer:
            from relax.megatron import distopt

            self.ddp, self.optimizer = distopt.wrap(
                self.model,
                lr=s.lr,
                min_lr=s.lr * s.min_lr_ratio,
                weight_decay=s.weight_decay,
                betas=s.betas,
                eps=s.eps,
                bf16=self.dtype == torch.bfloat16,
            )
        elif trainable:
            if self.dtype != torch.float32:
                from relax.megatron.precision import MasterWeights

                self.masters = MasterWeights(self.grad_params)  # the towers' included
                self.grad_params = self.masters.named()
            params = [p for _, p in self.grad_params]
            self.optimizer = torch.optim.AdamW(
                params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay
            )
        else:
            self.optimizer = None
        # chunked scores (chunked.py): the last stage's forward returns hidden states, scored a chunk at a time
        chunked = self.last_stage and s.logits_chunk_tokens > 0
        self.head = (
            OutputPassthrough(self.model, self.tp_group, self.tp, self.sequence_parallel) if chunked else None
        )
        # MoE routing replay: a batch's ``routed_experts`` fed to this stage's routers (routing.py); None: dense
        self.routing = MegatronRouting.for_model(
            self.model, s.routing_replay, self.hf_config.num_hidden_layers
        )
        if (
            self.routing is not None and self.sequence_parallel
        ):  # each TP rank routes its slice of the sequence
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

    # ------------------------------------------------------------------ forward
    def _on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's tensors on this rank's device (CPU: the batch itself)."""
        if self.device.type == "cpu":
            return batch
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }

    def _forward(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This stage's forward on the right-padded rows, causal attention with no mask tensor (padding.py):
        logits on the last stage (its last hidden states when the scores are chunked: chunked.py), hidden
        states on the others; MoE routers replay ``routed_experts`` when the batch has them (routing.py)."""
        with self.head.hidden_out() if self.head is not None else contextlib.nullcontext():
            return self._stage_forward(model, batch)

    def _stage_forward(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.front is not None:  # a media model: HF's front feeds megatron's LM (media_front.py)
            return self.front.lm_forward(model, batch)
        input_ids, position_ids = right_padded(batch)
        width = input_ids.shape[1]
        if self.sequence_parallel:  # the sequence splits over the TP ranks, padded; the logits cut again
            input_ids, position_ids = (
                pad_to_multiple(input_ids, 1, self.tp),
                pad_to_multiple(position_ids, 1, self.tp),
            )
        with self.routing.applied(batch) if self.routing is not None else contextlib.nullcontext():
            out = model(input_ids, position_ids, attention_mask=None)
        return out[:, :width] if self.sequence_parallel and self.last_stage else out

    def _scores(
        self, batch: dict[str, torch.Tensor], out: torch.Tensor, score: Callable = logprobs_and_entropy
    ):
        """``score`` (vocab-parallel) of the response tokens, (B, R) each: positions P-1 .. P+R-2 predict
        them; logits temperature-scaled, each rank's its vocabulary slice; ``out``: the last stage's forward."""
        out = response_logits(out, batch)
        local_vocab = out.shape[-1] if self.head is None else self.head.weight.shape[0]
        vocab_start = self.tp_rank * local_vocab
        real = self.hf_config.vocab_size - vocab_start  # this slice's columns that are real tokens

        def scored(logits: torch.Tensor, targets: torch.Tensor) -> tuple:
            if self.settings.temperature != 1.0:
                logits = logits / self.settings.temperature
            if real < local_vocab:  # the vocabulary padded to a multiple of TP (convert.Dims.padded_vocab)
                padding = torch.arange(local_vocab, device=logits.device) >= real
                logits = logits.masked_fill(padding, -1e30)  # finite: entropy's p * log p stays 0, not nan
            return score(logits, targets, vocab_start, self.tp_group if self.tp > 1 else None)

        if self.head is None:
            return scored(out, batch["responses"])
        return chunked_scores(
            out, batch["responses"], self.head.weight, scored, self.settings.logits_chunk_tokens
        )

    def _masked_scores(
        self, batch: dict[str, torch.Tensor], score: Callable, count: int
    ) -> list[torch.Tensor]:
        """The first ``count`` outputs of ``score`` over the whole batch (micro-batched, no grad), 0 where
        masked; with DP each replica scores its rows and every rank gets all of them."""
        if self.dp == 1:
            return self._replica_scores(batch, score, count)
        local = self._replica_scores(rank_rows(batch, self.dp, self.dp_rank), score, count)
        return [gather_rows(t, batch["responses"].shape[0], self.dp, self.dp_group) for t in local]

    def _replica_scores(
        self, batch: dict[str, torch.Tensor], score: Callable, count: int
    ) -> list[torch.Tensor]:
        def masked(sub: dict[str, torch.Tensor], logits: torch.Tensor) -> list[torch.Tensor]:
            keep = sub["response_mask"] > 0
            return [
                torch.where(keep, t, torch.zeros_like(t)) for t in self._scores(sub, logits, score)[:count]
            ]

        budget = (
            self.settings.max_tokens_per_micro_batch if self.pp == 1 else 0
        )  # PP: one shape (validate_run)
        micros = micro_batches(batch, self.settings.micro_batch_size, budget)
        with torch.no_grad():
            if self.pp == 1:
                records = [masked(sub, self._forward(self.model, sub)) for sub in micros]
            else:  # the last stage scores; its results go to every stage (rank 0 answers for the group)
                records = run_schedule(
                    self.model,
                    micros,
                    self._forward,
                    lambda sub, logits: (torch.zeros(()), masked(sub, logits)),
                    forward_only=True,
                    seq_multiple=self.seq_multiple,
                )
        if self.pp == 1:
            pieces = [list(zip(micros, [r[i] for r in records], strict=True)) for i in range(count)]
            return [in_row_order(p, *batch["responses"].shape) for p in pieces]
        shape = tuple(batch["responses"].shape)
        out = [
            torch.cat([r[i] for r in records]) if self.last_stage else torch.zeros(shape, device=self.device)
            for i in range(count)
        ]
        return from_last_stage(out)[0]

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) fp32 log-probs of the response tokens, 0 where ``response_mask`` is 0."""
        return self._masked_scores(self._on_device(batch), logprobs_and_entropy, 1)[0].cpu()

    def forward_logprobs_and_sum_pi_squared(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs`` and, from the same forward, the (B, R) ``sum_v pi(v)^2`` of the policy at
        ``temperature`` (optimal token baselines), vocab-parallel; both 0 where masked."""
        from relax.megatron.logprobs import logprobs_and_sum_pi_squared

        logprobs, sum_sq = self._masked_scores(self._on_device(batch), logprobs_and_sum_pi_squared, 2)
        return logprobs.cpu(), sum_sq.cpu()

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError(
            "the megatron trainer has no critic yet: use trainer.backend torch or fsdp with algorithm.critic"
        )

    # ----------------------------------------------------------------- training
    def current_lr(self) -> float:
        return self.update.current_lr()

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One update of core's loop (:meth:`PolicyUpdate.train_step`): ``num_minibatches`` optimizer
        steps, metrics averaged over them; ``old_logprobs`` scored before any update when absent; with
        ``routed_experts`` on an MoE model, core's ``routing/*`` metrics first (routing.py)."""
        if self.optimizer is None or self.update.objective is None:
            raise RuntimeError("train_step needs a trainable MegatronTrainer with an objective")
        batch = self._on_device(batch)
        routing = routing_metrics(
            self.routing,
            batch,
            self.settings.micro_batch_size,
            score=lambda sub: self._masked_scores(sub, logprobs_and_entropy, 1)[0],
            device=self.device,
        )
        return {**self.update.train_step(batch), **routing}

    # ------------------------------------------------------- ModelStep (the loop's calls)
    def local_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's rows, padded to the same count on every replica (``parallel.rank_rows``)."""
        return rank_rows(batch, self.dp, self.dp_rank)

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._replica_scores(batch, logprobs_and_entropy, 1)[0]

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
        grads.sum_data_parallel_grads(self.grad_params, self.dp, self.dp_group)
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
