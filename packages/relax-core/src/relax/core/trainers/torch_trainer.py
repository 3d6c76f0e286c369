"""Built-in torch trainer: any HF causal LM, AdamW, replicated data parallel; a backend of core's loop.

The trainer knows nothing about the algorithm (prime-rl style): ``train_step`` is core's
:class:`~relax.core.policy_update.PolicyUpdate` (mini-batches, accumulation with step-global counts,
the objective, old-logprob fusion, LR schedule, non-finite handling, metrics); this class supplies
the model step (:class:`~relax.core.policy_update.ModelStep`): logprobs and entropy of a micro-batch,
backward, the optimizer step, and sums over its data-parallel group.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax.core.algorithms import logprobs_from_logits
from relax.core.multimodal_model import freeze_switches, freeze_towers_by_switch, is_tower
from relax.core.policy_update import LossFn, Objective, PolicyUpdate, UpdateSettings
from relax.core.policy_update.batching import replica_rows, shard_bounds, take_rows
from relax.core.routing_replay import RoutingReplay
from relax.core.trainers import lora as lora_adapters
from relax.core.trainers.critic import Critic, critic_from_context
from relax.core.trainers.data_parallel import DataParallel
from relax.core.trainers.export import buckets, in_dtype
from relax.core.trainers.offload import Offloadable
from relax.core.trainers.optim import clip_gradients, step_checked
from relax.core.trainers.policy_trainer import PolicyTrainer, adamw_from, loop_inputs, seeded
from relax.core.trainers.recompute import recompute_blocks
from relax.core.trainers.response_forward import ResponseLogits, forward_backward, score_rows
from relax.core.trainers.routing import routing_metrics

_STATE_FILE = "trainer_state.pt"

#: log p(token) from (..., V) logits, in fp32 (logsumexp form: no (..., V) log-softmax copy)
token_logprobs = logprobs_from_logits


class TorchTrainer(PolicyTrainer, Offloadable):
    """``Trainer`` over ``AutoModelForCausalLM`` on one device.

    ``settings`` (core's :class:`UpdateSettings`; keyword ``overrides`` replace some of its fields, for
    scripts and tests) holds the optimisation, schedule and loss settings. ``trainable=False`` builds a
    frozen model (reference role): no optimizer, ``train_step`` refuses. ``settings.temperature``
    divides the logits (as verl does with the rollout temperature) so logprobs match a sampler at that
    temperature. ``critic`` (PPO) is trained on every ``train_step`` whose batch carries ``values`` and
    ``returns`` (see the loop). ``data_parallel``: this process is one rank of a data-parallel group
    (every method is then called on every rank with the same batch; each rank computes its share of
    the rows and rank 0 returns the result, see ``relax.core.trainers.data_parallel``); a critic is
    then a replica on each rank, built with the same ``data_parallel``.
    ``share_prompts``: rows with the same prompt (a GRPO group) run it once per micro-batch
    (``relax.core.trainers.shared_prefix``).

    ``dtype`` bfloat16 / float16 on a trainable model is mixed precision, not a bf16 model: the
    weights (the master copy), gradients and AdamW state stay fp32 and forwards run under autocast
    in ``dtype`` -- AdamW on bf16 weights rounds an RL-sized update (lr 1e-6) away. Exported
    weights are cast to ``dtype``, what the engines run. A frozen model (reference) loads in ``dtype``.

    ``lora`` (``relax.core.config.LoraConfig``): train adapters only (``relax.core.trainers.lora``): the
    base loads frozen in ``dtype``, exports, checkpoints and ``save_hf`` hold the adapter only, and
    :meth:`forward_reference_logprobs` scores the base with the adapters disabled.
    """

    def __init__(
        self,
        model_path: str,
        settings: UpdateSettings | None = None,
        *,
        objective: Objective | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        trainable: bool = True,
        critic: Critic | None = None,
        data_parallel: DataParallel | None = None,
        freeze_media_towers: bool = False,
        freeze_vision: bool = False,
        freeze_audio: bool = False,
        share_prompts: bool = True,
        lora: Any = None,
        **overrides: Any,
    ) -> None:
        from transformers import AutoTokenizer

        from relax.core.multimodal_model import load_model

        self.settings = s = seeded(settings, overrides)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.compute_dtype = getattr(torch, dtype)
        # a VL / Omni checkpoint loads as image-text-to-text; a trainable one in fp32 (the masters)
        self.lora = lora if trainable else None
        self._adapters_held = (
            threading.RLock()
        )  # a hosting actor runs old- and reference-logprob forwards at once
        self.model = load_model(model_path, "float32" if trainable and self.lora is None else dtype)
        self.model.requires_grad_(trainable)
        # VL / Omni: the towers (and their mergers) of these kinds stay as loaded and are left out of weight syncs
        self.frozen_towers = freeze_towers_by_switch(
            self.model,
            freeze_media_towers=freeze_media_towers,
            freeze_vision=freeze_vision,
            freeze_audio=freeze_audio,
        )
        if self.lora is not None:  # the base frozen in dtype, the adapters trainable in fp32
            self.model = lora_adapters.add_adapters(self.model, self.lora)
        self.model.to(self.device).eval()  # eval: no dropout, so training and scoring forwards agree
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw_from(params, s, self.device) if trainable else None
        self.critic = critic  # data-parallel: built with the same DataParallel (each rank a replica)
        self.dp = data_parallel
        self.recomputed = recompute_blocks(
            self.model, s.recompute if trainable else "off"
        )  # the blocks it wraps
        # a recomputed block re-runs with the KV cache the shared-prompt forward has since extended: not both
        share_prompts = share_prompts and not self.recomputed
        self.response_logits = ResponseLogits(
            self.model,
            s.temperature,
            share_prompts,
            chunk_tokens=s.logits_chunk_tokens,
            pack=s.pack_sequences,
        )
        self.response_logits.routing = RoutingReplay.for_model(
            self.model, s.routing_replay
        )  # MoE routing replay
        self.update = PolicyUpdate(
            self,
            s,
            objective if trainable else None,
            critic=critic,
            fuse_old_logprobs=self.fuses_old_logprobs(),
        )

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.rank

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.world_size

    # ------------------------------------------------------------------ forward
    def _response_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R, V) logits predicting each response token (``ResponseLogits``), in ``dtype``."""
        with self._autocast():
            return self.response_logits(batch)

    def _stats(self, batch: dict[str, Any], **kw: Any) -> torch.Tensor:
        """(k, B, R) per-token stats of the response tokens (``ResponseLogits.stats``), fp32."""
        with self._autocast():
            return self.response_logits.stats(batch, **kw)

    @property
    def packs_sequences(self) -> bool:
        return self.response_logits.pack

    def _autocast(self) -> torch.autocast:
        mixed = self.compute_dtype != torch.float32 and next(self.model.parameters()).dtype == torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=mixed)

    @property
    def share_prompts(self) -> bool:
        return self.response_logits.share_prompts

    @share_prompts.setter
    def share_prompts(self, value: bool) -> None:
        self.response_logits.share_prompts = value

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) fp32 log-probs of the response tokens, 0 where ``response_mask`` is 0; CPU tensor.
        Data-parallel: each rank scores its rows; rank 0 returns all of them, other ranks None."""
        return self._score_all_ranks(batch, sum_pi_squared=False)

    def forward_logprobs_and_sum_pi_squared(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``forward_logprobs`` and, from the same forward, the (B, R) fp32 ``sum_v pi(v)^2`` of the
        policy at ``temperature`` (what optimal token baselines weigh returns by), both 0 where
        masked; one (micro-batch, R, V) temporary, no larger than the logprobs' own logsumexp needs
        (measured: no higher peak than ``forward_logprobs``). The logprobs are bit-identical to
        ``forward_logprobs``'. Optional capability (``SupportsSumPiSquared``); data-parallel as
        ``forward_logprobs`` (one gather for both)."""
        both = self._score_all_ranks(batch, sum_pi_squared=True)
        return None if both is None else (both[:, 0], both[:, 1])

    def _score_all_ranks(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor | None:
        with (
            self._adapters_held
        ):  # LoRA: never while a concurrent reference forward has the adapters disabled
            return self._score_each_rank(batch, sum_pi_squared)

    def _score_each_rank(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor | None:
        if self.dp is None:
            return self._score(batch, sum_pi_squared)
        rows, width = batch["responses"].shape
        local = take_rows(batch, *shard_bounds(rows, self.dp.rank, self.dp.world_size))
        empty = torch.zeros((0, 2, width) if sum_pi_squared else (0, width))
        scored = self._score(local, sum_pi_squared) if local["responses"].shape[0] else empty
        return self.dp.gather_rows(scored, rows)

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``ModelStep.score``: this rank's rows, (B, R) masked logprobs, no grad; CPU tensor."""
        return self._score(batch, sum_pi_squared=False)

    def _score(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor:
        """(B, R) logprobs, or with ``sum_pi_squared`` (B, 2, R) logprobs and sum_v pi^2; masked, CPU."""
        s = self.settings
        batch = self._on_device(batch)
        budget = s.max_tokens_per_micro_batch
        return score_rows(
            self._stats,
            batch,
            s.micro_batch_size,
            sum_pi_squared,
            max_tokens=budget,
            packed=self.packs_sequences,
        )

    def forward_reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``forward_logprobs`` of the reference policy: with LoRA the base with the adapters disabled
        (no second copy of the weights); without, there is no reference in this trainer."""
        if self.lora is None:
            raise RuntimeError(
                "forward_reference_logprobs needs trainer.lora (the reference is the base model)"
            )
        with (
            self._adapters_held,
            lora_adapters.base_only(self.model),
        ):  # the toggle is the module's, not the call's
            return self.forward_logprobs(batch)

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) critic values of the response states, 0 where masked; CPU tensor."""
        if self.critic is None:
            raise RuntimeError("forward_values needs a critic (algorithm.critic.enable=true)")
        if self.dp is None:
            return self.critic.forward_values(batch)
        rows, width = batch["responses"].shape  # data-parallel: each rank its rows, rank 0 all of them
        local = take_rows(batch, *shard_bounds(rows, self.dp.rank, self.dp.world_size))
        values = self.critic.forward_values(local) if local["responses"].shape[0] else torch.zeros((0, width))
        return self.dp.gather_rows(values, rows)

    # ----------------------------------------------------------------- training
    def step_metrics(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """``train_step`` (``PolicyTrainer``'s, core's loop): MoE routing metrics before the update."""
        return routing_metrics(self.response_logits, batch, self.settings.micro_batch_size, self._autocast)

    def fuses_old_logprobs(self) -> bool:
        """``train_step`` accepts a batch without ``old_logprobs`` and takes the first mini-batch's
        from its own training forward (no separate pass): the controller then skips its old-logprob
        forward. Exact: both are this model's logprobs before the first update, in the same
        micro-batches, so the loss and gradients are those of the separate forward. Not with LoRA
        dropout, which the training forwards apply and scoring forwards do not."""
        return getattr(self, "lora", None) is None or self.lora.dropout == 0

    # ------------------------------------------------------- ModelStep (the loop's calls)
    def local_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return replica_rows(batch, self.dp_rank, self.dp_size)

    def forward_backward(
        self, micro_batches: Sequence[dict[str, torch.Tensor]], loss_fn: LossFn
    ) -> list[dict[str, float]]:
        if (
            self.lora is not None and self.lora.dropout > 0
        ):  # the training forwards only (see fuses_old_logprobs)
            with lora_adapters.dropout_active(self.model):
                return forward_backward(self._stats, micro_batches, loss_fn)
        return forward_backward(self._stats, micro_batches, loss_fn)

    def _params_with_grads(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def finish_gradients(self, max_norm: float) -> float:
        params = self._params_with_grads()
        if self.dp is not None:  # every rank ran the same modules, so the same params have grads
            self.dp.all_reduce_grads(params)
        return clip_gradients(params, max_norm)

    def apply_gradients(self, lr: float) -> str | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return step_checked(self.optimizer, self._params_with_grads())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return values if self.dp is None else self.dp.sum(values)

    # ------------------------------------------------------------------ weights
    def _unique_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named state, tied weights once (first name wins, as in ``save_pretrained``)."""
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            if self.frozen_towers and is_tower(name, self.model, self.frozen_towers):
                continue  # frozen: the engines' copies are the loaded ones already
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                yield name, tensor

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, detached view of the live weight); a bucket exceeds ``bucket_bytes``
        only for one big tensor. Views, not copies: a transport copies each bucket once on its way
        (pack, object-store put, file write), so the export adds no memory; consume a bucket before
        the next ``train_step``."""
        dtype = (
            self.compute_dtype
        )  # fp32 masters go out in what the engines run (a copy then, bucket by bucket)
        if (
            self.lora is not None
        ):  # the adapter only (relax.core.trainers.lora): bytes in proportion to the rank
            named = lora_adapters.adapter_tensors(self.model)
            yield from buckets(((name, in_dtype(tensor, dtype)) for name, tensor in named), bucket_bytes)
            return
        yield from buckets(
            ((name, in_dtype(tensor.detach(), dtype)) for name, tensor in self._unique_tensors()),
            bucket_bytes,
        )

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """All weights as live views (no copy): consume before the next ``train_step``. With LoRA: what
        ``export_weights`` sends (the adapter, ``lora_B`` scaled)."""
        if self.lora is not None:
            return dict(lora_adapters.adapter_tensors(self.model))
        return {name: tensor.detach() for name, tensor in self._unique_tensors()}

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: str) -> None:
        """Model, optimizer, step counter (the LR schedule's only state) and RNG states, one file.
        Data-parallel: rank 0 writes (every rank holds the same state); every rank ``load``s."""
        if self.dp is not None and self.dp.rank != 0:
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        np_state = np.random.get_state()
        state = {
            # LoRA: the adapter only (the base is the model path's, frozen)
            "model": self.model.state_dict()
            if self.lora is None
            else lora_adapters.trainable_state(self.model),
            "lora": self.lora is not None,
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "step": self.step,
            "critic": self.critic.state_dict() if self.critic else None,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
                "python": random.getstate(),
            },
        }
        torch.save(state, path / _STATE_FILE)

    def load(self, directory: str) -> None:
        state = torch.load(Path(directory) / _STATE_FILE, map_location=self.device, weights_only=True)
        if state.get("lora", False) != (self.lora is not None):
            raise ValueError(
                f"{directory}: checkpoint {'has' if state.get('lora') else 'has no'} LoRA adapter, "
                f"but trainer.lora is {'set' if self.lora is not None else 'null'}"
            )
        if self.lora is not None:
            lora_adapters.load_trainable_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError(
                    f"{directory}: checkpoint has no critic state, but this trainer has a critic"
                )
            self.critic.load_state_dict(state["critic"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"]:
            torch.cuda.set_rng_state_all(rng["cuda"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, keys.cpu().numpy(), *rest))
        random.setstate(rng["python"])

    def save_hf(self, directory: str) -> None:
        """A plain HF model + tokenizer directory (``from_pretrained``-loadable, safetensors)."""
        if self.dp is not None and self.dp.rank != 0:
            return
        if (
            self.lora is not None
        ):  # the adapter in PEFT format (and merged weights when trainer.lora.export_merged)
            lora_adapters.save_final(
                self.model, self.tokenizer, directory, self.compute_dtype, self.lora.export_merged
            )
            return
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)


def trainer_from_context(params: Any, ctx: Any) -> TorchTrainer:
    """The ``torch`` backend's factory: ``params`` is ``TorchTrainerParams``, ``ctx.train`` carries
    core's optimisation settings and the algorithm. A trainable policy gets
    ``build_policy_objective(algorithm)`` and, with ``algorithm.critic.enable``, a ``Critic``; a
    frozen model (reference / teacher, ``ctx.train.trainable`` False) gets neither."""
    spec, t = ctx.train, ctx.train.optim
    dtype = params.dtype or ctx.dtype
    trainable = spec.trainable
    kwargs: dict[str, Any] = dict(dtype=dtype, device=params.device, **freeze_switches(params))
    settings, objective = loop_inputs(ctx)
    if ctx.world_size > 1:  # one rank of a worker group: the runtime set rank and rendezvous in ctx
        kwargs["data_parallel"] = DataParallel(
            ctx.index,
            ctx.world_size,
            ctx.master_addr,
            ctx.master_port,
            backend="nccl" if str(params.device).startswith("cuda") else "gloo",
            timeout_s=max(60.0, ctx.timeout_s),
        )
    kwargs["critic"] = critic_from_context(ctx, dtype, params.device, kwargs.get("data_parallel"))
    return TorchTrainer(
        ctx.model_path,
        settings,
        objective=objective,
        trainable=trainable,
        lora=getattr(t, "lora", None),
        **kwargs,
    )


def trainer_from_config(cfg: Any, model_path: str, reference: bool = False) -> TorchTrainer:
    """Convenience for scripts and tests: the ``torch`` backend as ``relax run`` would build it."""
    from relax.core.controller.contexts import plugin_params, trainer_context

    ctx = trainer_context(cfg, model_path, role="reference" if reference else "trainer")
    return trainer_from_context(plugin_params(cfg, "trainer"), ctx)
