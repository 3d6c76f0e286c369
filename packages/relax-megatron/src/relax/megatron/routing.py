"""MoE routing replay (R3) on megatron-core: a batch's ``routed_experts`` replayed by this stage's routers.

megatron-core 0.16's ``TopKRouter`` asks its ``router_replay`` object for the top k when it has one
(``topk_routing_with_score_function``; what ``TransformerConfig.moe_enable_routing_replay`` turns on).
Megatron's own ``RouterReplay`` keeps one process-global list of routers and replays every token; Relax needs
per-model state (a policy and a reference may share a process) and tokens without a record (``-1``: padding,
the last sampled token) routed by the model itself, so each router gets a :class:`_LayerReplay` of its own with
the same method. The router still computes its scores: the recorded experts' weights are its scores gathered at
the recorded ids (megatron's top-k-then-softmax renormalises them, as Qwen3-MoE's ``norm_topk_prob``; with
``moe_router_pre_softmax`` they are the plain probabilities), so the router keeps its gradient, as core's
torch trainer does (``relax.core.routing_replay``).

Token layout: the batch column is ``(B, P + R, layers, k)`` aligned with core's left-padded rows; the model runs
right-padded rows (:mod:`relax.megatron.padding`) with ``(S, B)`` hidden states, which the router flattens
sequence-major. Each pipeline stage's routers take their own (global) layers' columns; TP and EP ranks route
the same tokens (routing comes before the dispatcher), so every rank gets the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from relax.megatron.padding import left_pads, rotate_left

Tensor = torch.Tensor


def token_routing(routed: Tensor, attention_mask: Tensor) -> Tensor:
    """``(S * B, layers, k)`` ids in the order megatron's routers see a right-padded micro-batch's tokens
    (sequence-major), from the left-padded ``(B, S, layers, k)`` batch column."""
    shift = left_pads(attention_mask)
    rows = rotate_left(routed, shift) if bool(shift.any()) else routed
    return rows.transpose(0, 1).reshape(-1, *routed.shape[2:])


def sequence_slice(tokens: Tensor, rows: int, tp: int, tp_rank: int) -> Tensor:
    """TP rank ``tp_rank``'s share of sequence-major ``(S * rows, ...)`` ids under sequence parallelism: the
    sequence padded to a multiple of ``tp`` with unrecorded (-1) tokens (as the trainer pads it), then split."""
    extra = -(tokens.shape[0] // rows) % tp * rows
    if extra:
        tokens = torch.cat([tokens, tokens.new_full((extra, *tokens.shape[1:]), -1)])
    per = tokens.shape[0] // tp
    return tokens[tp_rank * per : (tp_rank + 1) * per]


def moe_layer_pattern(freq: int | list[int], num_layers: int) -> list[int]:
    """1 for each decoder layer with experts, 0 for a dense one, from megatron's ``moe_layer_freq`` (every
    ``freq``-th layer, or an explicit list: dense first layers)."""
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(num_layers)]


class _LayerReplay:
    """One router's replay: megatron's ``RouterReplay.get_replay_topk`` interface. Without a target the model's
    own top k; with one, the recorded experts for tokens that have a record, counting (token) mismatches when
    ``counts`` is given."""

    def __init__(self) -> None:
        self.target: Tensor | None = None  # (tokens, k) ids, -1 where unrecorded
        self.replay = False
        self.counts: list[Tensor] | None = None

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, own
        wanted = self.target.to(own.device, torch.long)
        if wanted.shape != own.shape:
            raise ValueError(
                f"routing replay: routed_experts gives {tuple(wanted.shape)} (tokens, k) for a router "
                f"that routes {tuple(own.shape)}"
            )
        recorded = (wanted >= 0).all(-1)
        if self.counts is not None:
            same = (wanted.sort(-1).values == own.sort(-1).values).all(-1)
            self.counts.append(torch.stack([(recorded & ~same).sum(), recorded.sum()]))
        if not self.replay:
            return probs, own
        chosen = torch.where(recorded[:, None], wanted, own)
        return scores.gather(1, chosen), chosen


class MegatronRouting:
    """The routers of one megatron model (this pipeline stage's): :meth:`applied` around a forward feeds them
    the batch's routing. ``replay``: the trainer's setting; :meth:`measuring` overrides it for the metrics'
    forwards and counts how often the model's own top k differs from the record (:meth:`mismatch`)."""

    def __init__(self, routers: list[Any], replay: bool, num_layers: int) -> None:
        # the batch column holds MoE layers only (core records each MoE block's router, in layer order): a
        # router's column is the number of MoE layers before its (global, 0-based) layer
        pattern = moe_layer_pattern(routers[0].config.moe_layer_freq, num_layers)
        self.replay, self.num_layers = replay, sum(pattern)
        self.layers = [sum(pattern[: int(r.layer_number) - 1]) for r in routers]  # megatron counts from 1
        self.slots = [_LayerReplay() for _ in routers]
        for router, slot in zip(routers, self.slots, strict=True):
            router.router_replay = slot
        self._forced: bool | None = None
        self._counts: list[Tensor] = []
        self.sequence_split: tuple[int, int] | None = None  # (TP, TP rank) under sequence parallelism

    @classmethod
    def for_model(cls, model: torch.nn.Module, replay: bool, num_layers: int) -> MegatronRouting | None:
        """None for a dense model (a batch's routing is then ignored, as core's trainers do)."""
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            return None
        if routers[0].config.moe_router_fusion or any(r.layer_number is None for r in routers):
            raise ValueError(
                "routing replay: megatron's fused top-k (moe_router_fusion) bypasses the router's "
                "replay, and every router needs its layer_number"
            )
        return cls(routers, replay, num_layers)

    @contextmanager
    def applied(self, batch: dict[str, Any]) -> Iterator[None]:
        """The batch's ``routed_experts`` on every router for one forward (a no-op without them, or when neither
        replaying nor measuring)."""
        routed = batch.get("routed_experts")
        replay = self.replay if self._forced is None else self._forced
        if routed is None or not (replay or self._forced is not None):
            yield
            return
        if routed.shape[:2] != batch["input_ids"].shape or routed.shape[2] != self.num_layers:
            raise ValueError(
                f"routing replay: routed_experts {tuple(routed.shape)} should be (rows, tokens, "
                f"{self.num_layers} MoE layers, k) for input_ids {tuple(batch['input_ids'].shape)}"
            )
        tokens = token_routing(routed, batch["attention_mask"])
        if (
            self.sequence_split is not None
        ):  # sequence parallelism: this TP rank's routers route its slice only
            tokens = sequence_slice(tokens, routed.shape[0], *self.sequence_split)
        for slot, layer in zip(self.slots, self.layers, strict=True):
            slot.target, slot.replay = tokens[:, layer], replay
            slot.counts = self._counts if self._forced is not None else None
        try:
            yield
        finally:
            for slot in self.slots:
                slot.target, slot.counts = None, None

    @contextmanager
    def measuring(self, replay: bool) -> Iterator[None]:
        """Forwards in this block replay (or not) whatever the trainer's setting, and count mismatches."""
        self._forced, self._counts = replay, []
        try:
            yield
        finally:
            self._forced = None

    def mismatch(self, device: torch.device) -> float | None:
        """Recorded (token, MoE layer) pairs whose own top-k set differs from the record, over the measured
        forwards of every rank (collective: summed over the world; a TP rank's duplicates scale both counts
        alike); None if nothing was recorded."""
        counts = torch.stack(self._counts).sum(0) if self._counts else torch.zeros(2, dtype=torch.long)
        self._counts = []
        counts = counts.to(device, torch.float64)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(counts)
        differ, total = counts.tolist()
        return differ / total if total else None


def routing_metrics(
    routing: MegatronRouting | None, batch: dict[str, Any], rows: int, score, device
) -> dict[str, float]:
    """Core's ``train/routing/*`` metrics (``relax.core.trainers.routing``) on the first ``rows`` rows of a batch
    carrying ``routed_experts``, before the update: for ``replay`` and ``free`` (the model's own routing),
    ``routing/mismatch_frac_*`` and, with ``rollout_logprobs``, ``routing/logprob_diff_*``. ``score(sub)``: the
    sub-batch's masked (B, R) logprobs on every rank (collective). {} without routing."""
    from relax.core.policy_update.batching import take_rows
    from relax.core.routing_replay import logprob_diff

    if routing is None or "routed_experts" not in batch:
        return {}
    sub = take_rows(batch, 0, min(rows, batch["responses"].shape[0]))
    out: dict[str, float] = {}
    for name, replay in (("replay", True), ("free", False)):
        with torch.no_grad(), routing.measuring(replay):
            logprobs = score(sub)
        if (frac := routing.mismatch(device)) is not None:
            out[f"routing/mismatch_frac_{name}"] = frac
        if "rollout_logprobs" in sub:
            out[f"routing/logprob_diff_{name}"] = logprob_diff(
                logprobs.cpu(), sub["rollout_logprobs"].cpu(), sub["response_mask"].cpu()
            )
    return out
