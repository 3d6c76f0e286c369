"""Built-in torch trainer: any HF causal LM, AdamW, gradient accumulation, PPO-style mini-batches.

The trainer knows nothing about the algorithm (prime-rl style): ``train_step`` computes response
logprobs and entropy, packs them with the batch's columns into ``PolicyLossInputs`` and calls the
injected ``objective(inputs) -> (loss, metrics)``. Each micro-batch gets the token/sequence counts
of its whole mini-batch, so summing micro-batch losses (what backward does) equals one big batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax.core.algorithms import (
    PolicyLossInputs,
    entropy_from_logits,
    logprobs_and_sum_pi_squared,
    logprobs_from_logits,
    mismatch_metrics,
)
from relax.core.data_multimodal import has_media, unpack_media
from relax.core.multimodal_model import freeze_towers, is_tower, media_forward_kwargs
from relax.core.trainers.critic import Critic, split_rows
from relax.core.trainers.data_parallel import DataParallel, shard_bounds, take_rows
from relax.core.trainers.optim import LR_SCHEDULES, adamw, apply_update, lr_factor
from relax.core.trainers.shared_prefix import shared_prefix_logits

Objective = Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, Any]]]
_STATE_FILE = "trainer_state.pt"
_OPTIONAL_COLUMNS = ("rollout_logprobs", "ref_logprobs", "teacher_logprobs")


class NonFiniteError(FloatingPointError):
    """A train step produced a NaN/inf loss, gradient or weight; names the step."""


#: log p(token) from (..., V) logits, in fp32 (logsumexp form: no (..., V) log-softmax copy)
token_logprobs = logprobs_from_logits


class TorchTrainer:
    """``Trainer`` over ``AutoModelForCausalLM`` on one device.

    ``warmup_steps`` / ``total_steps`` count ``train_step`` calls: all mini-batches of one call use
    the same LR (as verl steps its scheduler once per update). ``trainable=False`` builds a frozen
    model (reference role): no optimizer, ``train_step`` refuses. ``temperature`` divides the
    logits (as verl does with the rollout temperature) so logprobs match a sampler at that temperature.
    ``critic`` (PPO) is trained on every ``train_step`` whose batch carries ``values`` and
    ``returns``; during the first ``critic_warmup_steps`` calls only the critic is updated.
    ``data_parallel``: this process is one rank of a data-parallel group (every method is then
    called on every rank with the same batch; each rank computes its share of the rows and rank 0
    returns the result, see ``relax.core.trainers.data_parallel``). ``share_prompts``: rows with the
    same prompt (a GRPO group) run it once per micro-batch (``relax.core.trainers.shared_prefix``).
    """

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
        dtype: str = "float32",
        device: str = "cpu",
        trainable: bool = True,
        critic: Critic | None = None,
        critic_warmup_steps: int = 0,
        skip_nonfinite: bool = False,
        data_parallel: DataParallel | None = None,
        freeze_media_towers: bool = False,
        share_prompts: bool = True,
    ) -> None:
        from transformers import AutoTokenizer

        from relax.core.multimodal_model import load_model

        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {lr_schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.objective = objective
        self.lr, self.grad_clip = lr, grad_clip
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.lr_schedule, self.min_lr_ratio = lr_schedule, min_lr_ratio
        self.micro_batch_size, self.num_minibatches = micro_batch_size, num_minibatches
        self.loss_agg_mode, self.temperature = loss_agg_mode, temperature
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = load_model(model_path, dtype)  # a VL / Omni checkpoint loads as image-text-to-text
        self.model.to(self.device).eval()  # eval: no dropout, so training and scoring forwards agree
        self.model.requires_grad_(trainable)
        # VL / Omni: the vision / audio towers (and their mergers) stay as loaded and are left out of weight syncs
        self.freeze_media_towers = freeze_media_towers and freeze_towers(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = (
            adamw(params, self.device, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay) if trainable else None
        )
        self.critic, self.critic_warmup_steps = critic, critic_warmup_steps
        self.skip_nonfinite = skip_nonfinite  # False: a NaN/inf loss or gradient raises NonFiniteError
        if data_parallel is not None and critic is not None:
            raise ValueError("the torch trainer's critic is not data-parallel: use world_size 1 with algorithm.critic")
        self.dp = data_parallel
        self.share_prompts = share_prompts
        self.step = 0

    # ------------------------------------------------------------------ forward
    def _response_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R, V) logits predicting each response token (positions P-1 .. P+R-2)."""
        resp_len = batch["responses"].shape[1]
        media = has_media(batch)
        logits = None if media else self._shared_prompt_logits(batch, resp_len)
        if logits is None:
            kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            if media:  # the rows' media, and 3-D positions from the model's own rope index
                ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1] - resp_len
                kwargs = media_forward_kwargs(self.model, ids, mask, unpack_media(batch), width)
            out = self.model(use_cache=False, logits_to_keep=resp_len + 1, **kwargs)
            logits = out.logits[:, -(resp_len + 1) : -1]  # some models (Omni thinkers) ignore logits_to_keep
        return logits if self.temperature == 1.0 else logits / self.temperature

    def _shared_prompt_logits(self, batch: dict[str, torch.Tensor], resp_len: int) -> torch.Tensor | None:
        """The group's samples share one pass over their prompt (``share_prompts``); None: plain forward."""
        if not self.share_prompts:
            return None
        try:
            return shared_prefix_logits(self.model, batch, resp_len)
        except NotImplementedError:  # a cache whose rows cannot be repeated (sliding window, ...)
            self.share_prompts = False
            return None

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

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
        if self.dp is None:
            return self._score(batch, sum_pi_squared)
        rows, width = batch["responses"].shape
        local = take_rows(batch, *shard_bounds(rows, self.dp.rank, self.dp.world_size))
        empty = torch.zeros((0, 2, width) if sum_pi_squared else (0, width))
        scored = self._score(local, sum_pi_squared) if local["responses"].shape[0] else empty
        return self.dp.gather_rows(scored, rows)

    def _logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._score(batch, sum_pi_squared=False)

    def _score(self, batch: dict[str, torch.Tensor], sum_pi_squared: bool) -> torch.Tensor:
        """(B, R) logprobs, or with ``sum_pi_squared`` (B, 2, R) logprobs and sum_v pi^2; masked, CPU."""
        batch = self._on_device(batch)
        chunks = []
        with torch.no_grad():
            for sub in split_rows(batch, self.micro_batch_size):
                logits, keep = self._response_logits(sub), sub["response_mask"] > 0
                if sum_pi_squared:
                    out = torch.stack(logprobs_and_sum_pi_squared(logits, sub["responses"]), dim=1)
                    keep = keep[:, None]
                else:
                    out = token_logprobs(logits, sub["responses"])
                del logits
                chunks.append(torch.where(keep, out, torch.zeros_like(out)))
        return torch.cat(chunks).cpu()

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) critic values of the response states, 0 where masked; CPU tensor."""
        if self.critic is None:
            raise RuntimeError("forward_values needs a critic (algorithm.critic.enable=true)")
        return self.critic.forward_values(batch)

    # ----------------------------------------------------------------- training
    def current_lr(self) -> float:
        return self.lr * lr_factor(
            self.step, self.warmup_steps, self.total_steps, self.lr_schedule, self.min_lr_ratio
        )

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One ``train_step``: ``num_minibatches`` optimizer steps over consecutive slices of the batch.

        Needs ``advantages`` (B, R). ``old_logprobs`` default to this model's logprobs before the
        first update, without a separate pass over the first mini-batch: its training forward
        provides them, detached (verl's on-policy shortcut; see :meth:`fuses_old_logprobs`), and
        one no-grad forward scores the later mini-batches before any update (none where the batch
        marks its ``rollout_logprobs_exact``: see :meth:`_old_logprobs_after_first`). ``rollout_logprobs`` /
        ``ref_logprobs`` / ``teacher_logprobs`` are passed through when present.

        Metrics, averaged over mini-batches: ``loss``, ``grad_norm`` (before clipping), ``entropy``
        (token mean), ``lr``, ``skipped_nonfinite`` (updates dropped for a NaN/inf loss or gradient,
        summed; only with ``skip_nonfinite``, else that raises ``NonFiniteError``) and the
        objective's metrics (``*loss`` keys summed over micro-batches, others token-weighted);
        with a critic also ``vf_loss``, ``vf_clip_frac``, ``values_mean``, ``critic_grad_norm``
        (actor metrics are absent during critic warm-up); with old logprobs computed here and
        ``rollout_logprobs`` given, ``rollout_logprob_abs_diff`` / ``rollout_k3_kl`` (rollout vs
        trainer, what the controller reports when it scores old logprobs itself).
        """
        if self.optimizer is None or self.objective is None:
            raise RuntimeError("train_step needs a trainable TorchTrainer with an objective")
        batch = self._on_device(batch)
        size = math.ceil(batch["responses"].shape[0] / self.num_minibatches)
        computed = "old_logprobs" not in batch  # scored here: report how far the rollout's were
        scored = None  # the mini-batches whose old logprobs this model scored (None: all)
        if self.dp is not None:
            minis = [self._rank_rows(mini) for mini in split_rows(batch, size)]
        elif computed:
            minis, scored = self._old_logprobs_after_first(batch, size)
        else:
            minis = list(split_rows(batch, size))
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        train_critic = self.critic is not None and "values" in batch and "returns" in batch
        train_actor = not (train_critic and self.step < self.critic_warmup_steps)
        records = []
        for mini in minis:
            record = self.critic.update(mini) if train_critic else {}
            if train_actor:
                record.update(self._optimizer_step(mini))
            records.append(record)
        self.step += 1
        metrics = {k: sum(r[k] for r in records) / (1 if k == "skipped_nonfinite" else len(records)) for k in records[0]}
        if computed and "rollout_logprobs" in batch and all("old_logprobs" in m for m in minis):
            metrics.update(self._rollout_mismatch(minis[:scored]))
        if self.critic is not None:
            metrics["actor_updated"] = float(train_actor)
        return {**metrics, "lr": lr}

    @staticmethod
    def fuses_old_logprobs() -> bool:
        """``train_step`` accepts a batch without ``old_logprobs`` and takes the first mini-batch's
        from its own training forward (no separate pass): the controller then skips its old-logprob
        forward. Exact: both are this model's logprobs before the first update, in the same
        micro-batches, so the loss and gradients are those of the separate forward."""
        return True

    def _old_logprobs_after_first(
        self, batch: dict[str, torch.Tensor], size: int
    ) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Mini-batches of ``size`` rows, and how many of them this model scores. The first has no
        ``old_logprobs``: ``_optimizer_step`` fills them in from its own forward (and stores them on
        the mini-batch). The later ones get them from one no-grad forward now, before any update --
        or, where every row is ``rollout_logprobs_exact`` (the engine sampled with this very module,
        see ``controller.stages.engine_scored_old_logprobs``), from ``rollout_logprobs``: no forward."""
        minis = list(split_rows(batch, size))
        if len(minis) > 1 and bool(batch.get("rollout_logprobs_exact", torch.zeros(1, dtype=torch.bool)).all()):
            for mini in minis[1:]:
                mini["old_logprobs"] = mini["rollout_logprobs"]
            return minis, 1
        if len(minis) > 1:
            rest = self._logprobs(take_rows(batch, size, batch["responses"].shape[0])).to(self.device)
            for i, mini in enumerate(minis[1:]):
                mini["old_logprobs"] = rest[i * size : (i + 1) * size]
        return minis, len(minis)

    def _rollout_mismatch(self, minis: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Rollout vs trainer old logprobs over the whole batch (token means; summed over ranks)."""
        tokens = abs_sum = k3_sum = 0.0
        for m in minis:
            n = float(m["response_mask"].sum())
            if n:
                mm = mismatch_metrics(m["old_logprobs"], m["rollout_logprobs"], m["response_mask"])
                tokens, abs_sum, k3_sum = tokens + n, abs_sum + n * mm["mismatch_abs_logprob_diff"], k3_sum + n * mm["mismatch_k3_kl"]
        if self.dp is not None:
            tokens, abs_sum, k3_sum = self.dp.sum([tokens, abs_sum, k3_sum])
        tokens = max(tokens, 1.0)
        return {"rollout_logprob_abs_diff": abs_sum / tokens, "rollout_k3_kl": k3_sum / tokens}

    def _rank_rows(self, mini: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of a mini-batch, with ``old_logprobs`` scored before any update. A rank
        with no rows takes one fully masked row: it still joins every collective, contributing 0."""
        start, end = shard_bounds(mini["responses"].shape[0], self.dp.rank, self.dp.world_size)
        rows = take_rows(mini, start, end) if end > start else take_rows(mini, 0, 1)
        if end == start:
            rows["response_mask"] = torch.zeros_like(rows["response_mask"])
        if "old_logprobs" not in rows:
            rows["old_logprobs"] = self._logprobs(rows).to(self.device)
        return rows

    def _optimizer_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        mask = batch["response_mask"]
        tokens = float(mask.sum())
        seqs = float((mask.sum(dim=-1) > 0).sum())
        if self.dp is not None:  # normalise by the whole mini-batch across ranks
            tokens, seqs = self.dp.sum([tokens, seqs])
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, entropy_sum, obj_sums = 0.0, 0.0, {}
        fused: list[torch.Tensor] = []  # old logprobs taken from this forward (see train_step)
        for sub in split_rows(batch, self.micro_batch_size):
            logits = self._response_logits(sub)
            logprobs = token_logprobs(logits, sub["responses"])
            entropy = entropy_from_logits(logits.float())
            if "old_logprobs" not in sub:  # exactly what _logprobs returns for these rows
                sub["old_logprobs"] = torch.where(sub["response_mask"] > 0, logprobs.detach(), 0.0)
                fused.append(sub["old_logprobs"])
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
            loss.backward()
            sub_mask = sub["response_mask"]
            sub_tokens = float(sub_mask.sum())
            loss_sum += float(loss.detach())
            entropy_sum += float((entropy.detach() * sub_mask).sum())
            for k, v in obj_metrics.items():
                # "*loss" terms use the global counts, so they add up; other metrics are local means
                weight = 1.0 if k.endswith("loss") else sub_tokens
                obj_sums[k] = obj_sums.get(k, 0.0) + (float(v) * weight if weight else 0.0)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp is not None:  # every rank ran the same modules, so the same params have grads
            self.dp.all_reduce_grads(params)
            keys = sorted(obj_sums)
            loss_sum, entropy_sum, *sums = self.dp.sum([loss_sum, entropy_sum, *(obj_sums[k] for k in keys)])
            obj_sums = dict(zip(keys, sums, strict=True))
        grad_norm, problem, stepped = apply_update(self.optimizer, params, self.grad_clip, loss_sum)
        skipped = not stepped
        if problem is not None:  # a NaN/inf update would destroy the weights: dropped, or the run stops
            self._nonfinite(problem, skippable=skipped)  # weights already non-finite: skipping cannot help
        if fused:
            batch["old_logprobs"] = torch.cat(fused)
        denom = max(tokens, 1.0)
        return {
            **{k: v if k.endswith("loss") else v / denom for k, v in obj_sums.items()},
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "entropy": entropy_sum / denom,
            "skipped_nonfinite": float(skipped),
        }

    def _nonfinite(self, what: str, skippable: bool = True) -> None:
        if not (self.skip_nonfinite and skippable):
            hint = "; trainer.skip_nonfinite=true skips such updates instead of stopping" if skippable else ""
            raise NonFiniteError(f"train step {self.step + 1}: {what}. Lower trainer.lr or check rewards and advantages{hint}")

    # ------------------------------------------------------------------ weights
    def _unique_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named state, tied weights once (first name wins, as in ``save_pretrained``)."""
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            if self.freeze_media_towers and is_tower(name):
                continue  # frozen: the engines' copies are the loaded ones already
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                yield name, tensor

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, detached view of the live weight); a bucket exceeds ``bucket_bytes``
        only for one big tensor. Views, not copies: a transport copies each bucket once on its way
        (pack, object-store put, file write), so the export adds no memory; consume a bucket before
        the next ``train_step``."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._unique_tensors():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.detach()))
            size += nbytes
        if bucket:
            yield bucket

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """All weights as live views (no copy): consume before the next ``train_step``."""
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
            "model": self.model.state_dict(),
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
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError(f"{directory}: checkpoint has no critic state, but this trainer has a critic")
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
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)


def trainer_from_context(params: Any, ctx: Any) -> TorchTrainer:
    """The ``torch`` backend's factory: ``params`` is ``TorchTrainerParams``, ``ctx.train`` carries
    core's optimisation settings and the algorithm. A trainable policy gets
    ``build_policy_objective(algorithm)`` and, with ``algorithm.critic.enable``, a ``Critic``; a
    frozen model (reference / teacher, ``ctx.train.trainable`` False) gets neither."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.context import train_kwargs

    spec, t = ctx.train, ctx.train.optim
    dtype = params.dtype or ctx.dtype
    trainable = spec.trainable
    kwargs: dict[str, Any] = dict(
        **train_kwargs(ctx), skip_nonfinite=t.skip_nonfinite, dtype=dtype, device=params.device,
        freeze_media_towers=getattr(params, "freeze_media_towers", False),
    )
    objective = build_policy_objective(spec.algorithm) if trainable else None
    if ctx.world_size > 1:  # one rank of a worker group: the runtime set rank and rendezvous in ctx
        if spec.algorithm.critic.enable and trainable:
            raise ValueError("trainer.backend_params.world_size > 1 with algorithm.critic.enable: the torch "
                             "trainer's critic is not data-parallel yet; use world_size 1")
        kwargs["data_parallel"] = DataParallel(
            ctx.index, ctx.world_size, ctx.master_addr, ctx.master_port,
            backend="nccl" if str(params.device).startswith("cuda") else "gloo", timeout_s=max(60.0, ctx.timeout_s),
        )
    c = spec.algorithm.critic
    if c.enable and trainable:
        kwargs["critic_warmup_steps"] = c.warmup_steps
        kwargs["critic"] = Critic(
            c.model_path or ctx.model_path,
            lr=c.lr,
            weight_decay=c.weight_decay,
            betas=tuple(t.betas),
            eps=t.eps,
            grad_clip=c.grad_clip,
            value_clip=c.value_clip,
            loss_agg_mode=c.loss_agg_mode,
            micro_batch_size=t.micro_batch_size,
            dtype=dtype,
            device=params.device,
        )
    return TorchTrainer(ctx.model_path, objective=objective, trainable=trainable, **kwargs)


def trainer_from_config(cfg: Any, model_path: str, reference: bool = False) -> TorchTrainer:
    """Convenience for scripts and tests: the ``torch`` backend as ``relax run`` would build it."""
    from relax.core.controller.contexts import plugin_params, trainer_context

    ctx = trainer_context(cfg, model_path, role="reference" if reference else "trainer")
    return trainer_from_context(plugin_params(cfg, "trainer"), ctx)
