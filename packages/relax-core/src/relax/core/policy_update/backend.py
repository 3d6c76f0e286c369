"""``ModelStep``: what a trainer backend supplies to core's policy-update loop -- the model step only.

The loop (:class:`relax.core.policy_update.PolicyUpdate`) owns everything algorithmic: mini-batches,
micro-batch accumulation with step-global token counts, the objective, old-logprob fusion, the LR
schedule, non-finite handling and the metrics. A backend owns its model, its optimizer and its
process groups (data, tensor, pipeline, expert parallel), and answers the calls below. Every rank
of a backend is called with the same arguments, in the same order, so a collective inside any of
them meets its peers.

A backend then wraps the loop into the outer ``Trainer`` protocol the controller calls
(``relax.core.protocols.Trainer``): core's ``relax.core.trainers.policy_trainer.PolicyTrainer`` is that
glue (``step``, ``current_lr``, ``train_step = PolicyUpdate(backend, ...).train_step``); the backend adds
its own ``forward_logprobs``, ``export_weights``, ``save`` / ``load`` and optional ``save_hf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Batch = dict[str, Any]
#: ``loss_fn(micro_batch, logprobs, entropy) -> (loss, record)``: logprobs / entropy are (b, R) fp32 per
#: response token, with grad; ``loss`` is what the backend back-propagates; ``record`` a dict of floats
LossFn = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


@runtime_checkable
class ModelStep(Protocol):
    """A trainer backend's model step, as core's policy-update loop calls it.

    ``dp_rank`` / ``dp_size``: this process's data-parallel replica and the number of replicas (1 when
    the backend is not data-parallel). Each replica trains on its own rows (:meth:`local_rows`); the
    loop sums counts and metrics over replicas with :meth:`all_reduce_sum`.
    """

    dp_rank: int
    dp_size: int

    def local_rows(self, batch: Batch) -> Batch:
        """This replica's rows of a mini-batch (called only when ``dp_size > 1``). A replica may pad
        its share with fully masked rows (e.g. to run the same shapes as its peers); those must
        contribute 0. Core's ``batching.replica_rows`` is the usual answer."""
        ...

    def score(self, batch: Batch) -> torch.Tensor:
        """(B, R) fp32 log-probs of ``batch``'s response tokens under the current weights, 0 where
        ``response_mask`` is 0; no grad, micro-batched as the backend likes, this replica's rows only
        (no gathering across replicas). The loop calls it for old logprobs before any update."""
        ...

    def forward_backward(self, micro_batches: Sequence[Batch], loss_fn: LossFn) -> list[dict[str, float]]:
        """For each micro-batch in order: compute per-token logprobs and entropy of its responses
        (logits at the settings' temperature, with grad), call ``loss_fn(micro, logprobs, entropy)`` and
        back-propagate the returned loss, accumulating gradients (never zeroing them). Returns the
        records ``loss_fn`` returned, in order, on every rank (a pipeline-parallel backend runs its
        schedule with ``loss_fn`` on the last stage and broadcasts the records)."""
        ...

    def finish_gradients(self, max_norm: float) -> float:
        """After the micro-batches of one mini-batch: reduce the gradients over the backend's groups
        (data-parallel sum, tied or replicated weights), clip them to ``max_norm`` (``inf``: no clip)
        and return the whole model's gradient norm before clipping, the same on every rank (NaN/inf
        when a gradient is not finite: the loop then calls :meth:`zero_grad` and skips or raises)."""
        ...

    def apply_gradients(self, lr: float) -> str | None:
        """One optimizer step at learning rate ``lr`` with the finished gradients. Returns None, or a
        sentence saying what went wrong that cannot be undone (e.g. the update made a weight
        non-finite); a backend that does not check returns None."""
        ...

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (before each mini-batch, and after a skipped update)."""
        ...

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums of ``values`` over the data-parallel replicas, in fp64, one collective;
        ``values`` itself when ``dp_size`` is 1."""
        ...
