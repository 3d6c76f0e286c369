"""Routing-replay metrics of a train step: how far the trainer's MoE routing and logprobs are from the rollout's,
with and without replaying the rollout's routing (``relax.core.routing_replay``; docs/moe.md)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from relax.core.algorithms import logprobs_from_logits
from relax.core.policy_update.batching import take_rows
from relax.core.routing_replay import logprob_diff
from relax.core.trainers.response_forward import ResponseLogits


def routing_metrics(
    response_logits: ResponseLogits,
    batch: dict[str, Any],
    rows: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, float]:
    """On the first ``rows`` rows of a batch carrying ``routed_experts`` (before the update): for ``replay`` and
    ``free`` (the model's own routing), ``routing/mismatch_frac_*`` (recorded (token, MoE layer) pairs whose
    trainer top-k set differs from the rollout's) and, with ``rollout_logprobs``, ``routing/logprob_diff_*``
    (mean |trainer - rollout| response logprob). Two no-grad forwards of one micro-batch; {} without routing."""
    routing = response_logits.routing
    if routing is None or "routed_experts" not in batch:
        return {}
    sub = take_rows(batch, 0, min(rows, batch["responses"].shape[0]))
    out: dict[str, float] = {}
    routing.mismatch()  # forget counts of earlier forwards
    for name, replay in (("replay", True), ("free", False)):
        with torch.no_grad(), autocast():
            logits = response_logits(sub, replay=replay)
        if (frac := routing.mismatch()) is not None:
            out[f"routing/mismatch_frac_{name}"] = frac
        if "rollout_logprobs" in sub:
            logprobs = logprobs_from_logits(logits, sub["responses"])
            out[f"routing/logprob_diff_{name}"] = logprob_diff(
                logprobs, sub["rollout_logprobs"], sub["response_mask"]
            )
    return out
