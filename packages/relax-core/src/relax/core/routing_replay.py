"""MoE routing replay (R3): the experts the rollout engine chose, recorded per token and replayed by the trainer.

An RL step on a mixture-of-experts model is unstable when the trainer's router picks other experts than
the engine's did for the same tokens (kernels, batch shapes and weight-sync rounding move router logits
across a top-k boundary). Rollout Routing Replay (R3, Ma et al. 2025, "Stabilizing MoE Reinforcement
Learning by Aligning Training and Inference Routers") records the engine's top-k expert ids and makes the
trainer's forward use them; the router's probabilities are still computed, so the chosen experts' weights
(softmax over all experts, gathered at the recorded ids, renormalised when the model's ``norm_topk_prob``
says so; for a sigmoid router its family's adapter declares -- ``model_family.MoeRouting`` -- the experts' own
sigmoid scores, renormalised and scaled as declared) keep their gradient.

Both sides work on any HF model whose sparse MoE block has a ``gate`` router module returning
``(router_logits, top_k_weights, top_k_index)`` next to an ``experts`` module, the router carrying ``top_k``
and ``norm_topk_prob`` (transformers 5 builds its Qwen MoE families this way). Both attach forward hooks
to the routers for one forward and remove them after it, so the model code is untouched.

Layout: one ``(tokens, moe_layers, top_k)`` integer array per sample over prompt + response tokens
(int8 up to 128 experts, int16 up to 32768); :data:`UNRECORDED` (-1) marks a token whose routing the
engine never computed (the last sampled token, which no forward fed) -- the trainer routes it itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

#: ``algorithm.routing_replay``: off; rollout (the policy's forwards replay); reference (the reference model's too)
REPLAY_MODES = ("off", "rollout", "reference")
UNRECORDED = -1


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of ``model``'s sparse MoE blocks, in layer order (empty for a dense model)."""
    return [
        module.gate
        for module in model.modules()
        if isinstance(getattr(module, "gate", None), torch.nn.Module)
        and isinstance(getattr(module, "experts", None), torch.nn.Module)
        and hasattr(module.gate, "top_k")
    ]


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed integer holding every expert id (``0 .. num_experts - 1``) and :data:`UNRECORDED`."""
    for dtype in (np.int8, np.int16):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def replays(mode: str, trainable: bool) -> bool:
    """Whether a trainer replays the rollout's routing: the policy for ``rollout`` and ``reference``, a frozen
    reference model only for ``reference``."""
    return mode in ("rollout", "reference") if trainable else mode == "reference"


class RoutingRecorder:
    """Forward hooks capturing each MoE router's top-k expert ids: after a forward, :meth:`take` gives them as
    one ``(batch, seq, layers, k)`` tensor (on CPU, compact dtype). The engine side of R3."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            name = type(model).__name__
            raise ValueError(
                f"routing replay: {name} has no sparse MoE block with a top-k router (gate + experts) "
                "to record; set algorithm.routing_replay: off for a dense model"
            )
        self.dtype = routing_dtype(max(int(getattr(r, "num_experts", 2**15)) for r in self.routers))
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._last[layer] = output[2].detach()

        return record

    def take(self, batch: int, seq: int) -> np.ndarray:
        """The last forward's routing as ``(batch, seq, layers, k)`` (the routers saw ``batch * seq`` tokens)."""
        if any(t is None for t in self._last):
            raise RuntimeError("routing replay: a forward ran without reaching every MoE router")
        stacked = torch.stack([t.reshape(batch, seq, -1) for t in self._last], dim=2)  # type: ignore[union-attr]
        self._last = [None] * len(self.routers)
        return stacked.to("cpu", torch.int32).numpy().astype(self.dtype)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def sequence_routing(context: np.ndarray, steps: Sequence[np.ndarray], tokens: int) -> np.ndarray:
    """One sample's ``(tokens, layers, k)`` array: its context's prefill, then one row per fed response token,
    :data:`UNRECORDED` rows for the tokens no forward saw (the last sampled one)."""
    rows = [context, *(s[None] for s in steps)]
    known = np.concatenate(rows) if len(rows) > 1 else context
    missing = tokens - known.shape[0]
    if missing < 0:
        raise ValueError(f"routing replay: {known.shape[0]} routed tokens for a {tokens}-token sequence")
    pad = np.full((missing, *known.shape[1:]), UNRECORDED, dtype=known.dtype)
    return np.concatenate([known, pad]) if missing else known


def pack_routing(
    routings: Sequence[np.ndarray | None], prompt_lens: Sequence[int], p_len: int, r_len: int
) -> torch.Tensor | None:
    """The batch column ``routed_experts``: ``(B, P + R, layers, k)`` in the samples' dtype, aligned with
    ``collate``'s left-padded prompts and right-padded responses, :data:`UNRECORDED` where nothing was recorded
    (padding, samples without routing). None when no sample has any."""
    recorded = [r for r in routings if r is not None]
    if not recorded:
        return None
    shaped = recorded[0]
    dtype = np.result_type(*(r.dtype for r in recorded))
    out = np.full((len(routings), p_len + r_len, *shaped.shape[1:]), UNRECORDED, dtype=dtype)
    for i, (routing, p) in enumerate(zip(routings, prompt_lens, strict=True)):
        if routing is not None:
            if routing.shape[1:] != shaped.shape[1:]:
                raise ValueError(
                    f"routing replay: sample {i} has routing {routing.shape[1:]}, another {shaped.shape[1:]}"
                )
            start = p_len - p
            out[i, start : start + routing.shape[0]] = routing[: p_len + r_len - start]
    return torch.from_numpy(out)


class RoutingReplay:
    """The trainer side of R3 on one model: :meth:`applied` runs a forward with the recorded routing (replay)
    or only measuring how far the model's own routing is from it; counts accumulate for :meth:`mismatch`
    (as device tensors: no synchronisation per layer)."""

    def __init__(self, model: torch.nn.Module, replay: bool) -> None:
        from relax.core.model_family import moe_routing

        self.routers = moe_routers(model)
        self.replay = replay
        self.declared = moe_routing(getattr(model, "config", None))  # None: a softmax router
        self._counts: list[torch.Tensor] = []  # per hooked router call: (differing, recorded) token counts

    @classmethod
    def for_model(cls, model: torch.nn.Module, replay: bool) -> RoutingReplay | None:
        """None for a model without MoE routers (its batches' routing, if any, is ignored)."""
        return cls(model, replay) if moe_routers(model) else None

    @contextmanager
    def applied(self, routed_experts: torch.Tensor, replay: bool | None = None) -> Iterator[None]:
        """Hooks for one forward over a ``(B, T, layers, k)`` batch column (the routers see ``B * T`` tokens);
        ``replay`` overrides the trainer's setting for this forward (the metrics compare both)."""
        if routed_experts.shape[2] != len(self.routers):
            raise ValueError(
                f"routing replay: the rollout recorded {routed_experts.shape[2]} MoE layers, the "
                f"trainer's model has {len(self.routers)}"
            )
        flat = routed_experts.flatten(0, 1)  # (B * T, layers, k), compact: each hook widens its own layer
        replay = self.replay if replay is None else replay
        handles = [
            r.register_forward_hook(self._hook(flat[:, i], replay)) for i, r in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, target: torch.Tensor, replay: bool) -> Any:
        def route(module: torch.nn.Module, args: Any, output: Any) -> Any:
            logits, weights, own = output
            wanted = target.to(own.device).long()
            recorded = (wanted >= 0).all(-1)
            if wanted.shape != own.shape:
                raise ValueError(
                    f"routing replay: recorded routing {tuple(wanted.shape)} for router output "
                    f"{tuple(own.shape)} (tokens, k)"
                )
            same = (wanted.sort(-1).values == own.sort(-1).values).all(-1)
            self._counts.append(torch.stack([(recorded & ~same).sum(), recorded.sum()]))
            if not replay:
                return None
            chosen = torch.where(recorded[:, None], wanted, own)
            return logits, self.weights(module, logits, chosen).to(weights.dtype), chosen

        return route

    def weights(self, module: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The ``chosen`` experts' weights as the router computes its own: softmax over all experts (renormalised
        when the router's ``norm_topk_prob``), or a declared sigmoid router's scores (renormalised, scaled)."""
        d = self.declared
        if d is None or d.score == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            norm = getattr(module, "norm_topk_prob", False) if d is None else d.norm_topk
            out = probs / probs.sum(dim=-1, keepdim=True) if norm else probs
        else:
            out = torch.sigmoid(logits.float()).gather(-1, chosen)
            out = out / (out.sum(dim=-1, keepdim=True) + 1e-20) if d.norm_topk else out
        return out if d is None or d.scaling == 1.0 else out * d.scaling

    def mismatch(self) -> float | None:
        """Recorded (token, MoE layer) pairs whose own top-k set differs from the rollout's, over the forwards
        since the last call (the router's own choice, whether replayed or not); None if none was recorded."""
        counts, self._counts = self._counts, []
        if not counts:
            return None
        differ, total = torch.stack(counts).sum(0).tolist()
        return differ / total if total else None


def logprob_diff(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean ``|trainer - rollout|`` logprob over the response tokens of ``mask``."""
    m = mask > 0
    return float((logprobs - rollout_logprobs).abs()[m].mean()) if bool(m.any()) else 0.0
