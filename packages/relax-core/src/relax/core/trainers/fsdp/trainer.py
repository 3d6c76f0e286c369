"""The FSDP2 trainer: one rank of a sharded HF model, a backend of core's policy-update loop.

Every rank holds 1/N of the fp32 master weights, their gradients and the AdamW state; a block is
gathered (in the compute dtype) only while it runs. Each rank trains on its own rows of every
mini-batch, padded to the same count so every rank runs the same forwards (each one is a
collective). The controller calls every method on every rank (core's worker group); rank 0
answers. Weight export is a collective too: each tensor is gathered in full, one at a time, and
rank 0 hands buckets of them to the transport.

``trainer.lora``: peft adapters are added to the frozen base (loaded in the compute dtype) before
sharding; the adapters (fp32) are the only trained, reduced and optimized shards, the reference is
the base with them disabled, and exports, checkpoints and the final export hold the adapter only
(``relax.core.trainers.lora``, as on the torch trainer).

``algorithm.critic``: each rank holds a whole critic (``relax.core.trainers.critic``; replicated, not
sharded) and trains it on its own rows; gradients and counts are summed over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from relax.core.multimodal_model import freeze_switches, freeze_towers_by_switch, is_tower
from relax.core.policy_update import LossFn, Objective, PolicyUpdate, UpdateSettings
from relax.core.policy_update.batching import even_replica_rows
from relax.core.policy_update.token_budget import most_over_replicas
from relax.core.routing_replay import RoutingReplay
from relax.core.trainers import lora as lora_adapters
from relax.core.trainers import sharded_load
from relax.core.trainers.critic import Critic, ReplicaSums, critic_from_context
from relax.core.trainers.data_parallel import DefaultGroupSums
from relax.core.trainers.export import buckets, in_dtype
from relax.core.trainers.fsdp import state
from relax.core.trainers.fsdp.layout import Layout, gather_rows, process_groups, world_sum
from relax.core.trainers.fsdp.params import FSDPParams, dtype_problem
from relax.core.trainers.fsdp.sharding import device_mesh, shard_model
from relax.core.trainers.offload import Offloadable
from relax.core.trainers.policy_trainer import PolicyTrainer, adamw_from, loop_inputs, seeded
from relax.core.trainers.process_group import join_default_group, releases_group_on_error
from relax.core.trainers.response_forward import ResponseLogits, forward_backward, score_rows
from relax.core.trainers.ulysses import SequenceParallel, check_heads


class FSDPTrainer(PolicyTrainer, Offloadable):
    """Rank ``rank`` of ``world_size`` (``trainer.backend: fsdp``). ``dtype`` is the compute dtype;
    the weights are loaded and kept in fp32 (with ``lora``: the frozen base in ``dtype``, the
    adapters in fp32). ``settings`` / ``overrides`` as the torch trainer's."""

    collective_export = True  # export_weights gathers every tensor across the ranks

    @releases_group_on_error
    def __init__(
        self,
        model_path: str,
        settings: UpdateSettings | None = None,
        *,
        objective: Objective | None = None,
        params: FSDPParams | None = None,
        dtype: str = "float32",
        rank: int = 0,
        world_size: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout_s: float = 300.0,
        trainable: bool = True,
        lora: Any = None,
        critic: Callable[[torch.device, ReplicaSums | None], Critic | None] | None = None,
        **overrides: Any,
    ) -> None:
        from transformers import AutoTokenizer

        from relax.core.multimodal_model import load_model

        p = params or FSDPParams(world_size=world_size)
        if problem := dtype_problem(dtype, p.device):
            raise ValueError(f"trainer.backend_params.{problem}")
        self.settings = s = seeded(settings, overrides)
        cuda = p.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.cuda.current_device())  # Ray gives each rank actor one GPU
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._owns_group = join_default_group(
            rank, world_size, master_addr, master_port, "nccl" if cuda else "gloo", timeout_s
        )
        self.rank, self.world_size, self.compute_dtype = rank, world_size, getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.lora = lora if trainable else None
        # the fp32 master copy, built empty and filled shard by shard below (no rank holds it whole);
        # LoRA (its adapters are initialised on real weights) or an unmapped checkpoint: loaded whole first
        hf, self._checkpoint = empty_sharded(model_path) if self.lora is None else (None, None)
        if hf is None:
            hf = load_model(model_path, "float32" if self.lora is None else dtype)
        hf.requires_grad_(trainable and self.lora is None)
        self.frozen_towers = freeze_towers_by_switch(
            hf, **freeze_switches(p)
        )  # kinds kept as loaded, unsynced
        # LoRA: the adapters join the HF modules in place (peft), so the blocks below shard with theirs
        self.model = hf if self.lora is None else lora_adapters.add_adapters(hf, self.lora)
        self.model.eval()  # no dropout: training and scoring forwards agree
        # media towers stay whole on every rank (see shard_model); on the device, as loaded
        self.replicated = [q for n, q in hf.named_parameters() if is_tower(n, hf)]
        for q in self.replicated if self._checkpoint is None else ():
            q.data = q.data.to(self.device)
        self.mesh = device_mesh(self.device.type, world_size, p.replicate)
        param_dtype = self.compute_dtype if self.lora is None else None  # LoRA: each weight in its own dtype
        if s.recompute not in ("off", "full"):
            raise ValueError(
                f"trainer.recompute: {s.recompute!r} is megatron's; the fsdp backend offers off | full"
            )
        recompute = trainable and (p.activation_checkpointing or s.recompute == "full")
        self.units = shard_model(
            self.model,
            self.mesh,
            param_dtype,
            replicated=set(self.replicated),
            reshard_after_forward=p.reshard_after_forward,
            activation_checkpointing=recompute,
            cpu_offload=p.cpu_offload,
        )
        if self._checkpoint is not None:  # each rank reads its shards' rows (and the towers whole)
            # cpu_offload: the shards' storage on the host from the start (FSDP pins it); the towers then move
            sharded_load.materialize(self.model, torch.device("cpu") if p.cpu_offload else self.device)
            sharded_load.fill(self.model, *self._checkpoint)
            self.replicated = [
                q for n, q in hf.named_parameters() if is_tower(n, hf)
            ]  # to_empty made them anew
            for q in self.replicated:
                q.data = q.data.to(self.device)
            self._checkpoint = None
        trained = [q for q in self.model.parameters() if q.requires_grad]
        self.optimizer = adamw_from(trained, s) if trainable else None
        self.response_logits = (
            ResponseLogits(  # recompute re-runs blocks with a since-extended KV cache: no sharing
                self.model,
                s.temperature,
                p.share_prompts and not recompute,
                chunk_tokens=s.logits_chunk_tokens,
                pack=s.pack_sequences,
            )
        )
        self.response_logits.routing = RoutingReplay.for_model(
            self.model, s.routing_replay
        )  # MoE routing replay
        # Ulysses: the ranks of a CP group run the same rows, each a slice of their tokens (fsdp/layout.py)
        self.layout = Layout(rank, world_size, p.context_parallel)
        self.context_parallel = p.context_parallel
        if p.context_parallel > 1:
            if not s.pack_sequences:
                raise ValueError(
                    "trainer.backend_params.context_parallel: splits packed rows; set trainer.pack_sequences: true"
                )
            check_heads(self.model, p.context_parallel)
        self.cp_group, self.dp_group = process_groups(self.layout)  # None: the default group (or unused)
        if p.context_parallel > 1:
            self.response_logits.sp = SequenceParallel(self.layout.cp_rank, p.context_parallel, self.cp_group)
        # PPO: a replicated (unsharded) critic on this rank's device, its gradients summed over the replicas
        # (whole rows on every rank of a CP group: summed over the DP group, once per replica)
        sums = DefaultGroupSums(self._comm_device(), self.dp_group) if self.dp_size > 1 else None
        self.critic = critic(self.device, sums) if critic is not None and trainable else None
        self.update = PolicyUpdate(
            self,
            s,
            objective if trainable else None,
            critic=self.critic,
            fuse_old_logprobs=self.fuses_old_logprobs(),
        )

    # --------------------------------------------------------------- loop's counters
    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ranks / ``context_parallel`` (a CP group's ranks share their rows)."""
        return self.layout.dp_size

    def fuses_old_logprobs(self) -> bool:
        """As the torch trainer: the first mini-batch's old logprobs come from its training forward
        (not with LoRA dropout, which the training forwards apply and scoring forwards do not)."""
        return getattr(self, "lora", None) is None or self.lora.dropout == 0

    # ------------------------------------------------------------------ scoring
    def _stats(self, batch: dict[str, Any], **kw: Any) -> torch.Tensor:
        return self.response_logits.stats(batch, **kw)

    @property
    def packs_sequences(self) -> bool:
        return self.response_logits.pack

    def _most_micro_batches(self, count: int) -> int:
        """The most micro-batches any rank runs (each forward is a collective: every rank runs as many)."""
        return most_over_replicas(count, self.dp_rank, self.dp_size, self.all_reduce_sum)

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, R) masked fp32 logprobs of the whole batch on rank 0 (None on the other ranks): each
        rank scores its share, rank 0 gathers them."""
        return self._score_all_ranks(batch, sum_pi_squared=False)

    def forward_logprobs_and_sum_pi_squared(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        both = self._score_all_ranks(batch, sum_pi_squared=True)
        return None if both is None else (both[:, 0], both[:, 1])

    def _score_all_ranks(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor | None:
        if self.dp_size == 1:  # one rank, or context parallelism alone: every rank scored every row
            scored = self._score(batch, sum_pi_squared)
            return scored if self.rank == 0 else None
        return self._gather_rows(
            self._score(self.local_rows(batch), sum_pi_squared), batch["responses"].shape[0]
        )

    def _gather_rows(self, local: torch.Tensor, rows: int) -> torch.Tensor | None:
        """Every replica's ``local_rows`` results as the batch's rows, on rank 0 (``layout.gather_rows``)."""
        return gather_rows(local.to(self._comm_device()), rows, self.layout, self.dp_group)

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, R) critic values of the response states, 0 where masked, on rank 0 (each rank scores its share)."""
        if self.critic is None:
            raise RuntimeError("forward_values needs a critic (algorithm.critic.enable=true)")
        if self.dp_size == 1:
            values = self.critic.forward_values(batch)
            return values if self.rank == 0 else None
        return self._gather_rows(
            self.critic.forward_values(self.local_rows(batch)), batch["responses"].shape[0]
        )

    def _score(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor:
        s, batch = self.settings, self._on_device(batch)
        budget = s.max_tokens_per_micro_batch
        return score_rows(
            self._stats,
            batch,
            s.micro_batch_size,
            sum_pi_squared,
            max_tokens=budget,
            equalize=self._most_micro_batches,
            packed=self.packs_sequences,
        )

    def forward_reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``forward_logprobs`` of the reference policy: with LoRA the base with the adapters disabled
        (no second copy of the weights); without, there is no reference in this trainer."""
        if self.lora is None:
            raise RuntimeError(
                "forward_reference_logprobs needs trainer.lora (the reference is the base model)"
            )
        with lora_adapters.base_only(self.model):
            return self.forward_logprobs(batch)

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------- ModelStep (the loop's calls)
    def local_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's rows (the same on every rank of a CP group)."""
        return even_replica_rows(batch, self.dp_rank, self.dp_size)

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._score(batch, sum_pi_squared=False)

    def forward_backward(
        self, micro_batches: Sequence[dict[str, torch.Tensor]], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        micro_batches = [self._on_device(m) for m in micro_batches]
        if (
            self.lora is not None and self.lora.dropout > 0
        ):  # the training forwards only (see fuses_old_logprobs)
            with lora_adapters.dropout_active(self.model):
                return forward_backward(self._stats, micro_batches, loss_fn)
        return forward_backward(self._stats, micro_batches, loss_fn)

    def finish_gradients(self, max_norm: float) -> float:
        """FSDP2 already summed each sharded gradient into its shard during backward; the replicated
        towers' gradients are summed here. The norm and the clip cover the whole model. A weight no
        row used on this rank (an expert no token chose, a tower without media) gets a zero
        gradient, so every rank reduces the same tensors."""
        trained = [q for q in self.model.parameters() if q.requires_grad]
        for q in trained:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        replicated = {id(q) for q in self.replicated}
        sharded = [q.grad for q in trained if id(q) not in replicated]
        whole = [q.grad for q in trained if id(q) in replicated]
        if whole and self.world_size > 1:
            flat = torch.cat([g.reshape(-1) for g in whole])
            dist.all_reduce(flat)
            torch._foreach_copy_(
                whole,
                [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in whole]), whole, strict=True)],
            )
        norms = [torch.nn.utils.get_total_norm(grads) for grads in (sharded, whole) if grads]
        norm = float(
            torch.stack(
                [(n.full_tensor() if hasattr(n, "full_tensor") else n).double().cpu() for n in norms]
            ).norm()
        )
        coef = max_norm / (norm + 1e-6)  # as torch's clip_grad_norm_
        if coef < 1.0:  # a NaN norm is not clipped: the loop skips or stops
            for grads in (sharded, whole):  # foreach ops take DTensors or tensors, not both
                if grads:
                    torch._foreach_mul_(grads, coef)
        return norm

    def apply_gradients(self, lr: float) -> str | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        shards = [
            q.to_local() if hasattr(q, "to_local") else q for q in self.model.parameters() if q.requires_grad
        ]
        shards = [t for t in shards if t.numel()]
        bad = float(
            0
            if not shards
            else (~torch.isfinite(torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float64)))).sum()
        )
        if world_sum(bad, self._comm_device()):  # each rank's own shards: over all ranks, not replicas
            return f"the update (lr {lr:g}) made the weights non-finite"
        return None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Summed over the replicas: the DP group (a CP group's ranks hold the same whole-row sums)."""
        if self.dp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    # ------------------------------------------------------------------ weights
    def _named_weights(self) -> Iterator[tuple[str, Any]]:
        """HF-named weights, each once (a tied head comes under the embedding's name, as in
        ``save_pretrained``); the same names in the same order on every rank."""
        seen: set[int] = set()
        for name, value in self.model.state_dict(keep_vars=True).items():
            if id(value) in seen or (self.frozen_towers and is_tower(name, self.model, self.frozen_towers)):
                continue
            seen.add(id(value))
            yield name, value

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of full (unsharded) tensors in the compute dtype, on rank 0; a collective: every
        rank iterates it in step (it yields nothing elsewhere). One tensor is gathered at a time, so
        no rank ever holds the whole model. LoRA: the adapter only (``lora.adapter_tensors``' names)."""
        named = self._named_weights() if self.lora is None else lora_adapters.adapter_tensors(self.model)
        full = (
            (name, in_dtype(state.gathered(value, self._comm_device()), self.compute_dtype))
            for name, value in named
        )
        if self.rank != 0:
            for _ in full:
                pass
            return
        yield from buckets(full, bucket_bytes)

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: str) -> None:
        """A sharded ``torch.distributed.checkpoint`` (loadable at any world size) + step and RNG; with
        LoRA the adapter and its optimizer state only."""
        meta = {"step": self.step, "rng": state.rng_state()}
        if self.critic is not None:  # replicated: rank 0's copy (the file rank 0 writes) is every rank's
            meta["critic"] = self.critic.state_dict()
        state.save(
            directory, self.model, self.optimizer, meta, self.rank, self.tokenizer, lora=self.lora is not None
        )

    def load(self, directory: str) -> None:
        meta = state.load(directory, self.model, self.optimizer, lora=self.lora is not None)
        if self.critic is not None:
            if meta.get("critic") is None:
                raise ValueError(
                    f"{directory}: checkpoint has no critic state, but this trainer has a critic"
                )
            self.critic.load_state_dict(meta["critic"])
        self.step = meta["step"]
        state.set_rng_state(meta["rng"])

    def save_hf(self, directory: str) -> None:
        """A plain HF model + tokenizer directory in the compute dtype (rank 0 writes; a collective).
        LoRA: the PEFT adapter (and merged weights with ``trainer.lora.export_merged``)."""
        if self.lora is not None:
            state.save_adapter(
                directory,
                self.model,
                self.tokenizer,
                self.compute_dtype,
                self.rank,
                self.lora.export_merged,
                self._comm_device(),
            )
            return
        state.save_hf(
            directory, self.model, self.tokenizer, self.compute_dtype, self.rank, self._comm_device()
        )

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def empty_sharded(model_path: str) -> tuple[Any, Any]:
    """The fp32 model with its parameters on meta and (checkpoint, plan) to fill its shards from; (None,
    None) where the checkpoint is not mapped tensor by tensor (then it is loaded whole, as said on the log)."""
    import logging

    from relax.core.safetensors_files import Checkpoint

    model, key_mapping = sharded_load.empty_model(model_path, "float32")
    if model is None:
        return None, None
    try:
        checkpoint = Checkpoint(model_path)
    except FileNotFoundError as exc:  # no safetensors (a .bin checkpoint): transformers reads it, whole
        logging.getLogger(__name__).warning("fsdp: %s is loaded whole on every rank: %s", model_path, exc)
        return None, None
    plan = sharded_load.Plan(model, checkpoint.names(), key_mapping)
    if missing := sharded_load.uncovered(model, plan):
        why = "fsdp: %s is loaded whole on every rank: no checkpoint tensor maps to %s"
        logging.getLogger(__name__).warning(why, model_path, missing[:5])
        return None, None
    return model, (checkpoint, plan)


def trainer_from_context(params: FSDPParams, ctx: Any) -> FSDPTrainer:
    """The ``fsdp`` backend's factory: one rank (``ctx.index`` of ``ctx.world_size``)."""
    spec = ctx.train
    dtype = params.dtype or ctx.dtype
    settings, objective = loop_inputs(ctx)
    return FSDPTrainer(
        ctx.model_path,
        settings,
        params=params,
        dtype=dtype,
        objective=objective,
        trainable=spec.trainable,
        rank=ctx.index,
        world_size=ctx.world_size,
        master_addr=ctx.master_addr,
        master_port=ctx.master_port,
        timeout_s=max(60.0, ctx.timeout_s),
        lora=getattr(spec.optim, "lora", None),
        critic=lambda device, sums: critic_from_context(ctx, dtype, device, sums),
    )
