"""The model step every HF-model backend shares: logits of a batch's response tokens, masked
logprobs without grad, and forward + backward over micro-batches.

Backends differ in where the weights live (one device, FSDP shards) and how gradients are reduced,
not in how an HF causal / VL / Omni model scores a response, so the torch and FSDP trainers both
compose these pieces (a ``logits_fn`` is a backend's ``batch -> (B, R, V)`` logits, overridable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax.core.algorithms import entropy_from_logits, logprobs_and_sum_pi_squared, logprobs_from_logits
from relax.core.data_multimodal import has_media, unpack_media
from relax.core.multimodal_model import media_forward_kwargs
from relax.core.policy_update import LossFn
from relax.core.policy_update.batching import split_rows
from relax.core.routing_replay import RoutingReplay
from relax.core.trainers.shared_prefix import shared_prefix_logits

Batch = dict[str, Any]
LogitsFn = Callable[[Batch], torch.Tensor]


class ResponseLogits:
    """``batch -> (B, R, V)`` logits predicting each response token (positions P-1 .. P+R-2), divided
    by ``temperature`` (so logprobs match a sampler at that temperature, as verl does).

    ``share_prompts``: rows with the same prompt (a GRPO group) run it once per micro-batch
    (``relax.core.trainers.shared_prefix``); switched off for good the first time the model's cache
    cannot repeat rows (sliding window, ...). Media rows always take the plain forward, with the
    model's own media kwargs and 3-D rope positions.
    """

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0, share_prompts: bool = True) -> None:
        self.model, self.temperature, self.share_prompts = model, temperature, share_prompts
        # MoE routing replay: a batch's ``routed_experts`` replayed (or measured) here; None: a dense model
        self.routing: RoutingReplay | None = None

    def __call__(self, batch: Batch, replay: bool | None = None) -> torch.Tensor:
        """``replay``: override the routing-replay setting for this forward (a batch with ``routed_experts``)."""
        routed = batch.get("routed_experts")
        if routed is not None and self.routing is not None:  # whole rows: the routing is per (row, position)
            with self.routing.applied(routed, replay):
                return self._logits(batch, shared=False)
        return self._logits(batch, shared=True)

    def _logits(self, batch: Batch, shared: bool) -> torch.Tensor:
        resp_len = batch["responses"].shape[1]
        media = has_media(batch)
        logits = None if media or not shared else self._shared_prompt_logits(batch, resp_len)
        if logits is None:
            kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            if media:
                ids, mask, width = batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1] - resp_len
                kwargs = media_forward_kwargs(self.model, ids, mask, unpack_media(batch), width,
                                              observed=batch.get("observation_mask"))
            out = self.model(use_cache=False, logits_to_keep=resp_len + 1, **kwargs)
            logits = out.logits[:, -(resp_len + 1) : -1]  # some models (Omni thinkers) ignore logits_to_keep
        return logits if self.temperature == 1.0 else logits / self.temperature

    def _shared_prompt_logits(self, batch: Batch, resp_len: int) -> torch.Tensor | None:
        if not self.share_prompts:
            return None
        try:
            return shared_prefix_logits(self.model, batch, resp_len)
        except NotImplementedError:  # a cache whose rows cannot be repeated
            self.share_prompts = False
            return None


def score_rows(logits_fn: LogitsFn, batch: Batch, micro_batch_size: int, sum_pi_squared: bool = False) -> torch.Tensor:
    """(B, R) fp32 logprobs of the responses, or with ``sum_pi_squared`` (B, 2, R) logprobs and
    ``sum_v pi(v)^2``; 0 where ``response_mask`` is 0; no grad, micro-batched; a CPU tensor."""
    chunks = []
    with torch.no_grad():
        for sub in split_rows(batch, micro_batch_size):
            logits, keep = logits_fn(sub), sub["response_mask"] > 0
            if sum_pi_squared:
                out = torch.stack(logprobs_and_sum_pi_squared(logits, sub["responses"]), dim=1)
                keep = keep[:, None]
            else:
                out = logprobs_from_logits(logits, sub["responses"])
            del logits
            chunks.append(torch.where(keep, out, torch.zeros_like(out)))
    return torch.cat(chunks).cpu()


def forward_backward(logits_fn: LogitsFn, micro_batches: Sequence[Batch], loss_fn: LossFn) -> list[dict[str, float]]:
    """``ModelStep.forward_backward`` for an HF model: fp32 logprobs and entropy of each micro-batch
    (with grad), ``loss_fn``, backward (gradients accumulate); the records in order."""
    records = []
    for sub in micro_batches:
        logits = logits_fn(sub)
        logprobs = logprobs_from_logits(logits, sub["responses"])
        entropy = entropy_from_logits(logits.float())
        loss, record = loss_fn(sub, logprobs, entropy)
        loss.backward()
        records.append(record)
    return records
