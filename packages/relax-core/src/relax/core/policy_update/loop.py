"""``PolicyUpdate``: one ``train_step`` of any trainer backend (prime-rl style: the loop knows the
algorithm only through the injected objective, the backend only through :class:`ModelStep`).

``num_minibatches`` optimizer steps over consecutive slices of the batch. Each slice is cut into
micro-batches that all get the slice's step-global token / sequence counts (summed over the
data-parallel replicas), so accumulating their gradients gives exactly the full-batch gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from relax.core.algorithms import PolicyLossInputs, mismatch_metrics
from relax.core.policy_update.backend import Batch, ModelStep
from relax.core.policy_update.batching import split_rows, take_rows
from relax.core.policy_update.memory import peak_metrics, reset_peaks
from relax.core.policy_update.schedule import lr_factor
from relax.core.policy_update.settings import UpdateSettings
from relax.core.policy_update.token_budget import (
    balanced_order,
    in_row_order,
    micro_batches,
    most_over_replicas,
    row_tokens,
    select_rows,
)

Objective = Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, Any]]]
OPTIONAL_COLUMNS = ("rollout_logprobs", "ref_logprobs", "teacher_logprobs")
_LOSS, _ENTROPY = "\0loss", "\0entropy"  # the loop's own sums in a micro-batch record
_POSITIONS, _REAL, _MICROS = "\0positions", "\0real", "\0micros"  # and of the micro-batches' shapes


class NonFiniteError(FloatingPointError):
    """A train step produced a NaN/inf loss, gradient or weight; names the step."""


class PolicyUpdate:
    """The policy-update loop over ``backend``. ``objective``: core's ``build_policy_objective(algorithm)``.
    ``critic`` (optional, PPO): an object with ``update(mini_batch) -> metrics`` trained on every call
    whose batch carries ``values`` and ``returns``; the first ``critic_warmup_steps`` calls train only it.
    ``fuse_old_logprobs``: the backend declares ``fuses_old_logprobs`` (see :meth:`train_step`).
    ``step`` counts ``train_step`` calls (the LR schedule's whole state: a backend checkpoints it)."""

    def __init__(
        self,
        backend: ModelStep,
        settings: UpdateSettings,
        objective: Objective | None,
        *,
        critic: Any = None,
        fuse_old_logprobs: bool = False,
    ) -> None:
        self.backend, self.settings, self.objective, self.critic = backend, settings, objective, critic
        self.fuse_old_logprobs = fuse_old_logprobs  # what the backend declares (capabilities.DECLARED)
        self.step = 0

    def current_lr(self) -> float:
        s = self.settings
        return s.lr * lr_factor(self.step, s.warmup_steps, s.total_steps, s.lr_schedule, s.min_lr_ratio)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One update on ``batch`` (on the backend's device). Needs ``advantages`` (B, R).

        ``old_logprobs`` default to the model's logprobs before the first update: a backend declaring
        ``fuses_old_logprobs`` takes the first mini-batch's from its own training forward (detached,
        verl's on-policy shortcut), and one no-grad forward scores the later mini-batches before any
        update (none where every row is ``rollout_logprobs_exact``: the engine sampled with this very
        module). ``rollout_logprobs`` / ``ref_logprobs`` / ``teacher_logprobs`` pass through.

        Metrics, averaged over mini-batches: ``loss``, ``grad_norm`` (before clipping), ``entropy``
        (token mean), ``lr``, ``skipped_nonfinite`` (summed; only with ``skip_nonfinite``, else a NaN/inf
        loss or gradient raises ``NonFiniteError``) and the objective's metrics (``*loss`` keys summed
        over micro-batches, others token-weighted); with a critic its metrics and ``actor_updated``
        (actor metrics are absent during critic warm-up); with old logprobs computed here and
        ``rollout_logprobs`` given, ``rollout_logprob_abs_diff`` / ``rollout_k3_kl`` (rollout vs trainer).
        """
        if self.objective is None:
            raise RuntimeError("train_step needs a trainable trainer with an objective")
        reset_peaks()
        computed = "old_logprobs" not in batch  # scored here: report how far the rollout's were
        minis, scored = self._minibatches(batch)
        lr = self.current_lr()
        train_critic = self.critic is not None and "values" in batch and "returns" in batch
        train_actor = not (train_critic and self.step < self.settings.critic_warmup_steps)
        records = []
        for mini in minis:
            record = self.critic.update(mini) if train_critic else {}
            if train_actor:
                record.update(self._optimizer_step(mini, lr))
            records.append(record)
        self.step += 1
        metrics = {
            k: sum(r[k] for r in records) / (1 if k == "skipped_nonfinite" else len(records))
            for k in records[0]
        }
        if computed and scored and "rollout_logprobs" in batch and all("old_logprobs" in m for m in minis):
            metrics.update(self._rollout_mismatch(minis[:scored]))
        if self.critic is not None:
            metrics["actor_updated"] = float(train_actor)
        return {**metrics, "lr": lr, **peak_metrics()}

    # ------------------------------------------------------------ old logprobs
    def _score(self, rows: Batch) -> torch.Tensor:
        return self.backend.score(rows).to(rows["responses"].device)

    def _minibatches(self, batch: Batch) -> tuple[list[Batch], int]:
        """This replica's mini-batches, with ``old_logprobs`` wherever the loop provides them before the
        update, and how many mini-batches' old logprobs this model scores (mismatch metrics)."""
        rows = batch["responses"].shape[0]
        size = math.ceil(rows / self.settings.num_minibatches)
        if (
            self.backend.dp_size > 1
        ):  # each replica scores its own rows of every mini-batch, before any update
            minis = [self.backend.local_rows(self._balanced(mini)) for mini in split_rows(batch, size)]
            for mini in minis:
                if "old_logprobs" not in mini:
                    mini["old_logprobs"] = self._score(mini)
            return minis, len(minis)
        minis = list(split_rows(batch, size))
        if "old_logprobs" in batch:
            return minis, len(minis)
        first = 1 if self.fuse_old_logprobs else 0  # the first mini-batch's come from its training forward
        if first and len(minis) > 1 and _all_exact(batch):
            for mini in minis[first:]:
                mini["old_logprobs"] = mini["rollout_logprobs"]
            return minis, first
        if len(minis) > first:
            rest = self._score(take_rows(batch, first * size, rows))
            for i, mini in enumerate(minis[first:]):
                mini["old_logprobs"] = rest[i * size : (i + 1) * size]
        return minis, len(minis)

    def _balanced(self, mini: Batch) -> Batch:
        """With a token budget, ``mini``'s rows reordered so every replica's share holds similar tokens."""
        if not self.settings.max_tokens_per_micro_batch:
            return mini
        order = balanced_order([int(n) for n in row_tokens(mini).tolist()], self.backend.dp_size)
        return select_rows(mini, torch.tensor(order, dtype=torch.long))

    def _micro_batches(self, mini: Batch) -> list[Batch]:
        """``micro_batch_size`` rows at a time, or token-budget micro-batches, as many on every replica."""
        b, s = self.backend, self.settings
        packed = getattr(b, "packs_sequences", False)

        def most(count: int) -> int:
            return most_over_replicas(count, b.dp_rank, b.dp_size, b.all_reduce_sum)

        return micro_batches(mini, s.micro_batch_size, s.max_tokens_per_micro_batch, packed, equalize=most)

    def _rollout_mismatch(self, minis: list[Batch]) -> dict[str, float]:
        """Rollout vs trainer old logprobs over the whole batch (token means; summed over replicas)."""
        tokens = abs_sum = k3_sum = 0.0
        for m in minis:
            n = float(m["response_mask"].sum())
            if n:
                mm = mismatch_metrics(m["old_logprobs"], m["rollout_logprobs"], m["response_mask"])
                tokens, abs_sum, k3_sum = (
                    tokens + n,
                    abs_sum + n * mm["mismatch_abs_logprob_diff"],
                    k3_sum + n * mm["mismatch_k3_kl"],
                )
        tokens, abs_sum, k3_sum = self.backend.all_reduce_sum([tokens, abs_sum, k3_sum])
        tokens = max(tokens, 1.0)
        return {"rollout_logprob_abs_diff": abs_sum / tokens, "rollout_k3_kl": k3_sum / tokens}

    # ---------------------------------------------------------------- update
    def _optimizer_step(self, mini: Batch, lr: float) -> dict[str, float]:
        backend, s = self.backend, self.settings
        mask = mini["response_mask"]  # this replica's rows; the counts cover every replica's
        tokens, seqs = backend.all_reduce_sum([float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())])
        backend.zero_grad()
        fused: list[tuple[Batch, torch.Tensor]] = []  # old logprobs taken from this forward (see train_step)

        def loss_fn(
            micro: Batch, logprobs: torch.Tensor, entropy: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, float]]:
            if "old_logprobs" not in micro:  # exactly what score returns for these rows
                micro["old_logprobs"] = torch.where(micro["response_mask"] > 0, logprobs.detach(), 0.0)
                fused.append((micro, micro["old_logprobs"]))
            inputs = PolicyLossInputs(
                logprobs=logprobs,
                old_logprobs=micro["old_logprobs"],
                advantages=micro["advantages"],
                response_mask=micro["response_mask"],
                entropy=entropy,
                loss_agg_mode=s.loss_agg_mode,
                global_token_count=tokens,
                global_seq_count=seqs,
                **{k: micro[k] for k in OPTIONAL_COLUMNS if k in micro},
            )
            loss, obj_metrics = self.objective(inputs)
            record = _weighted(obj_metrics, float(micro["response_mask"].sum()))
            record[_LOSS] = float(loss.detach())
            record[_ENTROPY] = float((entropy.detach() * micro["response_mask"]).sum())
            return loss, record

        micros = self._micro_batches(mini)
        records = backend.forward_backward(micros, loss_fn)
        records.append(_shape_record(micros, packed=getattr(backend, "packs_sequences", False)))
        keys = sorted({k for r in records for k in r})
        sums = dict(
            zip(
                keys, backend.all_reduce_sum([sum(r.get(k, 0.0) for r in records) for k in keys]), strict=True
            )
        )
        loss_sum, entropy_sum = sums.pop(_LOSS), sums.pop(_ENTROPY)
        positions, real, count = sums.pop(_POSITIONS), sums.pop(_REAL), sums.pop(_MICROS)
        grad_norm = backend.finish_gradients(s.grad_clip if s.grad_clip and s.grad_clip > 0 else float("inf"))
        skipped = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        if skipped:  # a NaN/inf update would destroy the weights: dropped, or the run stops
            backend.zero_grad()
            self._nonfinite(
                f"non-finite {'loss' if not math.isfinite(loss_sum) else 'gradient'} (loss {loss_sum}, "
                f"grad_norm {grad_norm}); the update was not applied",
                skippable=True,
            )
        elif problem := backend.apply_gradients(lr):
            self._nonfinite(problem, skippable=False)  # weights already non-finite: skipping cannot help
        if fused:
            mini["old_logprobs"] = in_row_order(fused, *mini["responses"].shape)
        denom = max(tokens, 1.0)
        return {
            "perf/micro_batches": count / backend.dp_size,  # per replica
            "perf/padding_frac": 1.0 - real / positions if positions else 0.0,
            **{k: v if k.endswith("loss") else v / denom for k, v in sums.items()},
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "entropy": entropy_sum / denom,
            "skipped_nonfinite": float(skipped),
        }

    def _nonfinite(self, what: str, skippable: bool) -> None:
        if not (self.settings.skip_nonfinite and skippable):
            hint = "; trainer.skip_nonfinite=true skips such updates instead of stopping" if skippable else ""
            raise NonFiniteError(
                f"train step {self.step + 1}: {what}. Lower trainer.lr or check rewards and advantages{hint}"
            )


def _shape_record(micros: list[Batch], packed: bool) -> dict[str, float]:
    """Positions the model runs (packed: the real tokens only), real tokens and micro-batches, to sum."""
    real = sum(float(m["attention_mask"].sum()) for m in micros)
    positions = real if packed else float(sum(m["attention_mask"].numel() for m in micros))
    return {_POSITIONS: positions, _REAL: real, _MICROS: float(len(micros))}


def _weighted(obj_metrics: dict[str, Any], tokens: float) -> dict[str, float]:
    """A micro-batch's objective metrics as sums: "*loss" terms use the global counts, so they add up
    as they are; the others are local means, weighted by the micro-batch's tokens."""
    out = {}
    for k, v in obj_metrics.items():
        weight = 1.0 if k.endswith("loss") else tokens
        out[k] = float(v) * weight if weight else 0.0
    return out


def _all_exact(batch: Batch) -> bool:
    return bool(batch.get("rollout_logprobs_exact", torch.zeros(1, dtype=torch.bool)).all())
