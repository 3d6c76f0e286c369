"""The forward and logprob path of a megatron trainer rank: a stage's forward on right-padded rows, vocab-parallel
scores of the response tokens, and the whole batch scored micro-batch by micro-batch (under PP by megatron's
schedule, the last stage's results sent to every stage; under DP each replica its rows, gathered).

:class:`MegatronForward` is the part of ``MegatronTrainer`` that reads the model and never changes it; it uses
the trainer's model, parallel layout (``tp``, ``pp``, ``dp``, ``cp`` and their ranks and groups), ``head``,
``front``, ``routing`` and ``settings``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from relax.core.policy_update.token_budget import in_row_order, micro_batches
from relax.megatron.chunked import chunked_scores
from relax.megatron.context_parallel import cp_response_scores, local_part
from relax.megatron.logprobs import logprobs_and_entropy
from relax.megatron.padding import pad_to_multiple, response_logits, right_padded
from relax.megatron.parallel import gather_rows, rank_rows
from relax.megatron.pipeline import from_last_stage, run_schedule


class MegatronForward:
    """Scoring on a megatron trainer rank (a mixin of ``MegatronTrainer``: see the module's docstring)."""

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
        # the sequence splits over the TP (sequence parallel) / CP ranks, padded; the logits cut again
        if self.seq_multiple > 1:
            input_ids, position_ids = (
                pad_to_multiple(input_ids, 1, self.seq_multiple),
                pad_to_multiple(position_ids, 1, self.seq_multiple),
            )
        if self.cp > 1:  # this CP rank's two chunks (context_parallel.py); its scores are gathered in _scores
            input_ids, position_ids = (
                local_part(input_ids, self.cp, self.cp_rank),
                local_part(position_ids, self.cp, self.cp_rank),
            )
        with self.routing.applied(batch) if self.routing is not None else contextlib.nullcontext():
            out = model(input_ids, position_ids, attention_mask=None)
        return out[:, :width] if self.sequence_parallel and self.last_stage and self.cp == 1 else out

    def _scores(
        self, batch: dict[str, torch.Tensor], out: torch.Tensor, score: Callable = logprobs_and_entropy
    ):
        """``score`` (vocab-parallel) of the response tokens, (B, R) each: positions P-1 .. P+R-2 predict
        them; logits temperature-scaled, each rank's its vocabulary slice; ``out``: the last stage's forward
        (under CP this rank's chunks: each scores its own positions, gathered over the CP group)."""
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

        def token_scores(x: torch.Tensor, targets: torch.Tensor) -> tuple:
            if self.head is None:
                return scored(x, targets)
            return chunked_scores(x, targets, self.head.weight, scored, self.settings.logits_chunk_tokens)

        if self.cp > 1:
            return cp_response_scores(batch, out, token_scores, self.cp, self.cp_rank, self.cp_group)
        return token_scores(response_logits(out, batch), batch["responses"])

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

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``ModelStep.score``: this replica's rows, (B, R) masked logprobs, no grad."""
        return self._replica_scores(batch, logprobs_and_entropy, 1)[0]
