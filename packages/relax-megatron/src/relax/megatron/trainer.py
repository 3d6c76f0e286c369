"""``MegatronTrainer``: relax's ``Trainer`` protocol on a megatron-core GPTModel (this rank's shard).

The model is built from the HF config and loaded from the HF safetensors through
:mod:`relax.megatron.convert`; logprobs and entropy are computed vocab-parallel
(:mod:`relax.megatron.logprobs`); the loss is core's policy objective with step-global token counts,
as in core's torch trainer, so the two give the same loss on the same batch. One process per rank of
megatron's TP x PP x DP world (gloo and float32 on CPU; NCCL, ``cuda:<local rank>`` and float32 or
bfloat16 with ``device="cuda"``: batches go to the device, results come back on CPU); every rank is
called with the whole batch, together (``export_weights`` gathers across TP, PP and EP, so it is
collective too: ``collective_export``, core's worker group has every rank export in step and sends rank
0's buckets). DP replicas take their share of the rows; token counts, loss sums and gradients are
summed over them (step-global normalisation).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from relax.megatron import convert
from relax.megatron.logprobs import logprobs_and_entropy

Objective = Callable[[Any], tuple[torch.Tensor, dict[str, Any]]]
NamedTensors = list[tuple[str, torch.Tensor]]
_OPTIONAL_COLUMNS = ("rollout_logprobs", "ref_logprobs", "teacher_logprobs")


def buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (one big tensor may exceed it)."""
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """(B, S) 0/1 key validity -> megatron's (B, 1, S, S) bool mask, True where attention is blocked
    (future positions and padding)."""
    s = valid.shape[1]
    future = torch.ones(s, s, dtype=torch.bool, device=valid.device).triu(1)
    return (future[None] | (valid[:, None, :] == 0))[:, None]


class MegatronTrainer:
    """One rank of a megatron-core trainer. ``trainable=False`` is a frozen reference (no optimizer)."""

    collective_export = True  # export_weights all-gathers the TP shards: every rank iterates it together

    def __init__(
        self,
        model_path: str,
        *,
        objective: Objective | None = None,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        total_steps: int = 0,
        lr_schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        micro_batch_size: int = 16,
        num_minibatches: int = 1,
        loss_agg_mode: str = "token-mean",
        temperature: float = 1.0,
        seed: int = 0,
        trainable: bool = True,
        skip_nonfinite: bool = False,
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
    ) -> None:
        from transformers import AutoConfig

        from megatron.core import parallel_state
        from relax.core.trainers.optim import LR_SCHEDULES
        from relax.megatron.parallel import ensure_process_group, initialize_model_parallel, rank_device

        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {lr_schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")
        if world_size != tensor_parallel * pipeline_parallel * data_parallel:
            raise ValueError(f"world_size={world_size} != tensor_parallel={tensor_parallel} x pipeline_parallel="
                             f"{pipeline_parallel} x data_parallel={data_parallel}")  # fmt: skip
        if data_parallel % expert_parallel:
            raise ValueError(f"expert_parallel={expert_parallel} must divide data_parallel={data_parallel}: "
                             "expert-parallel ranks are carved from the data-parallel ones, as in megatron")  # fmt: skip
        if dtype not in ("float32", "bfloat16") or (dtype != "float32" and device == "cpu"):
            raise ValueError(f"dtype={dtype!r}: float32 on CPU; float32 or bfloat16 on device cuda")
        self.device = rank_device(device, rank)
        if self.device.type == "cuda":  # before megatron builds anything: it allocates on the current device
            torch.cuda.set_device(self.device)
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.distributed_optimizer = distributed_optimizer and trainable
        if self.distributed_optimizer and self.device.type != "cuda":
            from relax.megatron.distopt import CPU_REASON

            raise ValueError(CPU_REASON)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        ensure_process_group(rank, world_size, master_addr, master_port,
                             backend="nccl" if self.device.type == "cuda" else "gloo")  # fmt: skip
        initialize_model_parallel(tensor_parallel, pipeline_parallel, seed=seed, expert_parallel=expert_parallel)
        self.model_path = model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
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
        # PP: core's objective already divides by step-global token counts, so megatron's schedule must
        # not rescale the loss
        pipeline = (dict(pipeline_model_parallel_size=pipeline_parallel, pipeline_dtype=self.dtype,
                         calculate_per_token_loss=True)
                    if pipeline_parallel > 1 else {})  # fmt: skip
        # bf16 (CUDA): parameters in bf16; logprobs, entropy and the loss are computed in fp32 (logprobs.py)
        precision = dict(params_dtype=torch.bfloat16, bf16=True) if self.dtype == torch.bfloat16 else {}
        if self.distributed_optimizer:  # megatron's DDP then sums gradients over DP, as our own path does
            precision["calculate_per_token_loss"] = True
        if expert_parallel > 1:
            pipeline["expert_model_parallel_size"] = expert_parallel
        self.model = convert.build_gpt_model(self.hf_config, pre_process=self.first_stage, post_process=self.last_stage,
                                             tensor_model_parallel_size=tensor_parallel,
                                             use_cpu_initialization=self.device.type == "cpu", **pipeline, **precision)  # fmt: skip
        convert.load_hf_into(self.model, convert.read_hf_checkpoint(model_path), self.hf_config, self.tp, self.tp_rank,
                             pipeline_parallel, self.pp_rank, expert_parallel, self.ep_rank)  # fmt: skip
        self.model.to(self.device)  # a no-op where megatron already allocated on the current GPU
        self.model.eval()  # no dropout: training and scoring forwards agree
        self.model.requires_grad_(trainable)
        self.objective = objective
        self.lr, self.grad_clip = lr, grad_clip
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.lr_schedule, self.min_lr_ratio = lr_schedule, min_lr_ratio
        self.micro_batch_size, self.num_minibatches = micro_batch_size, num_minibatches
        self.loss_agg_mode, self.temperature = loss_agg_mode, temperature
        self.skip_nonfinite = skip_nonfinite  # False: a NaN/inf loss or gradient raises NonFiniteError
        self.ddp = None  # megatron's DDP wrapper: with the distributed optimizer only
        if self.distributed_optimizer:
            from relax.megatron import distopt

            self.ddp, self.optimizer = distopt.wrap(self.model, lr=lr, min_lr=lr * min_lr_ratio, weight_decay=weight_decay,
                                                    betas=tuple(betas), eps=eps, bf16=self.dtype == torch.bfloat16)  # fmt: skip
        else:
            self.optimizer = (
                torch.optim.AdamW(self.model.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
                if trainable
                else None
            )
        self.step = 0

    # ------------------------------------------------------------------ forward
    def _on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's tensors on this rank's device (CPU: the batch itself)."""
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _response_scores(self, batch: dict[str, torch.Tensor], score: Callable = logprobs_and_entropy) -> tuple:
        """``score`` (vocab-parallel) of the response tokens: (B, R) logprobs and entropies by default.
        Positions P-1 .. P+R-2 predict them; logits are temperature-scaled; each rank holds its slice."""
        return self._scores(batch, self._forward(self.model, batch), score)

    @staticmethod
    def _forward(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This stage's forward: logits on the last stage, hidden states on the others."""
        return model(batch["input_ids"], batch["position_ids"], attention_mask(batch["attention_mask"]))

    def _scores(self, batch: dict[str, torch.Tensor], logits: torch.Tensor, score: Callable = logprobs_and_entropy):
        resp = batch["responses"]
        prompt_len = batch["input_ids"].shape[1] - resp.shape[1]
        logits = logits[:, prompt_len - 1 : prompt_len - 1 + resp.shape[1]]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        vocab_start = self.tp_rank * logits.shape[-1]
        return score(logits, resp, vocab_start, self.tp_group if self.tp > 1 else None)

    def _masked_scores(self, batch: dict[str, torch.Tensor], score: Callable, count: int) -> list[torch.Tensor]:
        """The first ``count`` outputs of ``score`` over the whole batch (micro-batched, no grad), 0 where
        masked; with DP each replica scores its rows and every rank gets all of them."""
        if self.dp == 1:
            return self._replica_scores(batch, score, count)
        from relax.megatron.parallel import gather_rows, rank_rows

        local = self._replica_scores(rank_rows(batch, self.dp, self.dp_rank), score, count)
        return [gather_rows(t, batch["responses"].shape[0], self.dp, self.dp_group) for t in local]

    def _replica_scores(self, batch: dict[str, torch.Tensor], score: Callable, count: int) -> list[torch.Tensor]:
        from relax.core.trainers.critic import split_rows

        def masked(sub: dict[str, torch.Tensor], logits: torch.Tensor) -> list[torch.Tensor]:
            keep = sub["response_mask"] > 0
            return [torch.where(keep, t, torch.zeros_like(t)) for t in self._scores(sub, logits, score)[:count]]

        micros = list(split_rows(batch, self.micro_batch_size))
        with torch.no_grad():
            if self.pp == 1:
                records = [masked(sub, self._forward(self.model, sub)) for sub in micros]
            else:  # the last stage scores; its results go to every stage (rank 0 answers for the group)
                from relax.megatron.pipeline import from_last_stage, run_schedule

                records = run_schedule(self.model, micros, self._forward,
                                       lambda sub, logits: (torch.zeros(()), masked(sub, logits)), forward_only=True)  # fmt: skip
        if self.pp == 1:
            return [torch.cat([r[i] for r in records]) for i in range(count)]
        shape = tuple(batch["responses"].shape)
        out = [torch.cat([r[i] for r in records]) if self.last_stage else torch.zeros(shape, device=self.device)
               for i in range(count)]  # fmt: skip
        return from_last_stage(out)[0]

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) fp32 log-probs of the response tokens, 0 where ``response_mask`` is 0."""
        return self._masked_scores(self._on_device(batch), logprobs_and_entropy, 1)[0].cpu()

    def forward_logprobs_and_sum_pi_squared(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs`` and, from the same forward, the (B, R) ``sum_v pi(v)^2`` of the policy at
        ``temperature`` (optimal token baselines), vocab-parallel; both 0 where masked."""
        from relax.megatron.logprobs import logprobs_and_sum_pi_squared

        logprobs, sum_sq = self._masked_scores(self._on_device(batch), logprobs_and_sum_pi_squared, 2)
        return logprobs.cpu(), sum_sq.cpu()

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("the megatron trainer has no critic yet: use trainer.backend: torch with algorithm.critic")

    # ----------------------------------------------------------------- training
    def current_lr(self) -> float:
        from relax.core.trainers.optim import lr_factor

        return self.lr * lr_factor(self.step, self.warmup_steps, self.total_steps, self.lr_schedule, self.min_lr_ratio)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """``num_minibatches`` optimizer steps over consecutive slices of the batch; metrics averaged
        over them (``loss``, ``grad_norm`` before clipping, token-mean ``entropy``, ``lr`` and the
        objective's). ``old_logprobs`` are scored here, before any update, when the batch has none."""
        from relax.core.trainers.critic import split_rows

        if self.optimizer is None or self.objective is None:
            raise RuntimeError("train_step needs a trainable MegatronTrainer with an objective")
        batch = self._on_device(batch)
        if "old_logprobs" not in batch:
            batch = {**batch, "old_logprobs": self._masked_scores(batch, logprobs_and_entropy, 1)[0]}
        size = math.ceil(batch["responses"].shape[0] / self.num_minibatches)
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.dp > 1:
            from relax.megatron.parallel import rank_rows

            minis = [rank_rows(mini, self.dp, self.dp_rank) for mini in split_rows(batch, size)]
        else:
            minis = list(split_rows(batch, size))
        records = [self._optimizer_step(mini) for mini in minis]
        self.step += 1
        metrics = {k: sum(r[k] for r in records) / (1 if k == "skipped_nonfinite" else len(records)) for k in records[0]}
        return {**metrics, "lr": lr}

    def _optimizer_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        from relax.core.algorithms import PolicyLossInputs
        from relax.core.trainers.critic import split_rows

        mask = batch["response_mask"]  # with DP: this replica's rows; counts and sums cover every replica's
        tokens, seqs = self._dp_sum([float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())])
        self._zero_grads()

        def micro_loss(sub: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, entropy = self._scores(sub, logits)
            inputs = PolicyLossInputs(
                logprobs=logprobs,
                old_logprobs=sub["old_logprobs"],
                advantages=sub["advantages"],
                response_mask=sub["response_mask"],
                entropy=entropy,
                loss_agg_mode=self.loss_agg_mode,
                global_token_count=tokens,
                global_seq_count=seqs,
                **{k: sub[k] for k in _OPTIONAL_COLUMNS if k in sub},
            )
            loss, obj_metrics = self.objective(inputs)
            sub_tokens = float(sub["response_mask"].sum())
            # "*loss" terms use the global counts, so they add up; the others are token-weighted
            record = {k: float(v) * (1.0 if k.endswith("loss") else sub_tokens) for k, v in obj_metrics.items()}
            return loss, {**record, "\0loss": float(loss.detach()),
                          "\0entropy": float((entropy.detach() * sub["response_mask"]).sum())}  # fmt: skip

        micros = list(split_rows(batch, self.micro_batch_size))
        if self.pp == 1:
            records = []
            for sub in micros:
                loss, record = micro_loss(sub, self._forward(self.model, sub))
                loss.backward()
                records.append(record)
        else:  # 1F1B: the last stage computes the loss; its sums go to every stage
            from relax.megatron.pipeline import from_last_stage, run_schedule

            records = from_last_stage([], run_schedule(self.model, micros, self._forward, micro_loss, forward_only=False))[1]
        keys = sorted(records[0])
        sums = dict(zip(keys, self._dp_sum([sum(r[k] for r in records) for k in keys]), strict=True))
        loss_sum, entropy_sum = sums.pop("\0loss"), sums.pop("\0entropy")
        obj_sums = sums
        if self.ddp is not None:  # megatron's DDP: its finalize_model_grads does the sums below
            from relax.megatron import distopt

            grad_norm = distopt.reduce_grads(self.ddp, self.optimizer)
        else:
            self._sum_qk_norm_grads()
            self._sum_tied_embedding_grads()
            self._sum_data_parallel_grads()
            max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
            grad_norm = self._clip_grad_norm(max_norm)
        skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))  # the same on every TP rank
        if skipped:  # a NaN/inf update would destroy the weights: drop it, or stop the run
            self._nonfinite(f"non-finite {'loss' if not math.isfinite(loss_sum) else 'gradient'} "
                            f"(loss {loss_sum}, grad_norm {grad_norm}); the update was not applied")  # fmt: skip
            self._zero_grads()
        elif self.ddp is not None:
            distopt.apply(self.optimizer, self.grad_clip)
        else:
            self.optimizer.step()
        denom = max(tokens, 1.0)
        return {
            **{k: v if k.endswith("loss") else v / denom for k, v in obj_sums.items()},
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "entropy": entropy_sum / denom,
            "skipped_nonfinite": float(skipped),
        }

    def _zero_grads(self) -> None:
        if self.ddp is not None:
            from relax.megatron import distopt

            distopt.zero_grads(self.ddp, self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _dp_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the data-parallel replicas (fp64, one collective); DP=1: ``values``."""
        if self.dp == 1:
            return values
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        torch.distributed.all_reduce(summed, group=self.dp_group)
        return summed.tolist()

    def _nonfinite(self, what: str) -> None:
        from relax.core.trainers.torch_trainer import NonFiniteError

        if not self.skip_nonfinite:
            raise NonFiniteError(f"train step {self.step + 1}: {what}. Lower trainer.lr or check rewards and "
                                 "advantages; trainer.skip_nonfinite=true skips such updates instead of stopping")  # fmt: skip

    def _sum_qk_norm_grads(self) -> None:
        """Qwen3's q/k norms are replicated but each TP rank applies them to its own heads: their gradient
        is the sum over ranks. What megatron's ``finalize_model_grads`` does
        (``_allreduce_non_tensor_model_parallel_grads``), without its DDP wrapper."""
        if self.tp == 1:
            return
        for name, param in self.model.named_parameters():
            if param.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                torch.distributed.all_reduce(param.grad, group=self.tp_group)

    def _sum_tied_embedding_grads(self) -> None:
        """PP with tied embeddings: the first stage's embedding and the last stage's output layer are one
        weight; each gets the sum of both gradients (megatron's ``_allreduce_word_embedding_grads``)."""
        from megatron.core import parallel_state

        if self.pp == 1 or not self.hf_config.tie_word_embeddings or not parallel_state.is_rank_in_embedding_group():
            return
        weight = self.model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _is_expert(self, name: str) -> bool:
        """An expert weight sharded over the EP ranks (each rank holds its own experts)."""
        return self.ep > 1 and ".mlp.experts." in name

    def _sum_data_parallel_grads(self) -> None:
        """Each replica back-propagated its own rows: sum the gradients over the data-parallel ranks
        (expert weights over the expert-data-parallel ranks: with EP the dispatcher already brought every
        EP rank's tokens to an expert)."""
        if self.dp == 1:
            return
        from megatron.core import parallel_state
        from relax.megatron.parallel import all_reduce_grads

        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        all_reduce_grads([p for n, p in named if not self._is_expert(n)], self.dp_group)
        if 1 < self.ep < self.dp:
            experts = [p for n, p in named if self._is_expert(n)]
            all_reduce_grads(experts, parallel_state.get_expert_data_parallel_group())

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip to the norm of the whole model's gradient; TP shards, pipeline stages and EP ranks'
        experts count once, replicated weights (norms, a tied embedding's copy) once, not once per rank.
        TP=PP=EP=1: torch's ``clip_grad_norm_``."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        params = [p for _, p in named]
        if self.tp == 1 and self.pp == 1 and self.ep == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        def square(grads: list[torch.Tensor], group) -> torch.Tensor:
            total = (torch.stack([g.float().square().sum() for g in grads]).sum() if grads
                     else torch.zeros((), device=self.device))  # fmt: skip
            torch.distributed.all_reduce(total, group=group)
            return total

        owned = [(n, p) for n, p in named if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)]
        total = square([p.grad for n, p in owned if not self._is_expert(n)], parallel_state.get_model_parallel_group())
        if self.ep > 1:
            experts = [p.grad for n, p in owned if self._is_expert(n)]
            total = total + square(experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        norm = float(total.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    # ------------------------------------------------------------------ weights
    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[NamedTensors]:
        """HF-named, TP- and PP-gathered weights in buckets of about ``bucket_bytes`` (tied embeddings
        once), streamed: one decoder layer (or top-level weight) is gathered and converted at a time."""
        from relax.megatron.parallel import gather_tp_shards

        local = convert.weights_only(self.model.state_dict())
        if self.pp > 1:  # whole-model layer numbers; the last stage's copy of a tied embedding left out
            from relax.megatron.pipeline import global_layer_names

            offset = convert.stage_layers(self.hf_config.num_hidden_layers, self.pp, self.pp_rank).start
            tied_copy = ("output_layer.weight",) if self.hf_config.tie_word_embeddings and not self.first_stage else ()
            local = global_layer_names(local, offset, tied_copy)
        units = convert.export_units(list(local))

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            if self.pp > 1:
                from relax.megatron.pipeline import stage_units

                source = stage_units(units, local)
            else:
                source = ({n: local[n].detach() for n in unit} for unit in units)
            # a unit's shards: the EP ranks' (MoE, TP=1: each holds its experts) or the TP ranks'
            width, group = (self.ep, self.ep_group) if self.ep > 1 else (self.tp, self.tp_group)
            for unit in source:
                shards = gather_tp_shards(unit, width, group)
                # on CPU for the transports (a no-op on CPU)
                yield from ((n, t.cpu()) for n, t in convert.megatron_to_hf(shards, self.hf_config, partial=True).items())

        yield from buckets(named(), bucket_bytes)

    def save_hf(self, directory: str) -> None:
        """An HF directory (config, tokenizer, safetensors) that plain transformers loads. Collective
        (every rank gathers); rank 0 writes it."""
        from relax.megatron.checkpoint import write_hf

        hf = {n: t for b in self.export_weights() for n, t in b}
        if torch.distributed.get_rank() == 0:
            write_hf(directory, hf, self.hf_config, self.model_path)

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: str) -> None:
        """A megatron dist checkpoint: model, optimizer, step and RNG (collective; see ``checkpoint``)."""
        from relax.megatron import checkpoint

        checkpoint.save(self, directory)

    def load(self, directory: str) -> None:
        """Resume from :meth:`save`'s directory, also one saved at another TP size."""
        from relax.megatron import checkpoint

        checkpoint.load(self, directory)
