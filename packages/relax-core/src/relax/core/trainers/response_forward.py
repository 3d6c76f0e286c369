"""The model step every HF-model backend shares: per-token stats of a batch's response tokens,
masked logprobs without grad, and forward + backward over micro-batches.

Backends differ in where the weights live (one device, FSDP shards) and how gradients are reduced,
not in how an HF causal / VL / Omni model scores a response, so the torch and FSDP trainers both
compose these pieces (a ``stats_fn`` is a backend's ``batch -> (k, B, R)`` stats, overridable).

Real lengths (docs/long-sequences.md): the stats come from the head's input hidden states a chunk of
tokens at a time (``token_stats``: no ``(tokens x V)`` fp32 tensor beyond one chunk), text rows can run
packed without padding (``packing``), and micro-batches can be sized in tokens (``token_budget``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from relax.core.algorithms import entropy_from_logits, logprobs_and_sum_pi_squared, logprobs_from_logits
from relax.core.data_multimodal import has_media, unpack_media
from relax.core.multimodal_model import media_forward_kwargs
from relax.core.policy_update import LossFn
from relax.core.policy_update.token_budget import micro_batches, scatter_rows
from relax.core.routing_replay import RoutingReplay
from relax.core.trainers.packing import enable_packing, pack_rows, packed_forward, packed_media_kwargs
from relax.core.trainers.shared_prefix import shared_prefix_logits
from relax.core.trainers.token_stats import HeadPassthrough, chunked_token_stats, head_is_plain
from relax.core.trainers.ulysses import SequenceParallel, sum_over_ranks

Batch = dict[str, Any]
#: ``stats_fn(batch, entropy=..., sum_pi_squared=...) -> (k, B, R)``: logprobs, then the stats asked for
StatsFn = Callable[..., torch.Tensor]


class ResponseLogits:
    """A batch's response tokens under the model: ``__call__`` gives the (B, R, V) logits predicting each
    response token (positions P-1 .. P+R-2), :meth:`stats` their per-token logprobs / entropy without
    them; both at ``temperature`` (logits divided by it, so logprobs match a sampler at that
    temperature, as verl does).

    ``share_prompts``: rows with the same prompt (a GRPO group) run it once per micro-batch
    (``relax.core.trainers.shared_prefix``); switched off for good the first time the model's cache
    cannot repeat rows (sliding window, ...). ``pack``: text rows run packed, no padding
    (``relax.core.trainers.packing``; replaces prompt sharing). ``chunk_tokens``: the head runs on this
    many tokens at a time in :meth:`stats` (0: all). Media rows always take the plain padded forward,
    with the model's own media kwargs and 3-D rope positions; so do rows replaying MoE routing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float = 1.0,
        share_prompts: bool = True,
        *,
        chunk_tokens: int = 1024,
        pack: bool = False,
    ) -> None:
        self.model, self.temperature, self.share_prompts = model, temperature, share_prompts
        self.chunk_tokens = chunk_tokens
        # MoE routing replay: a batch's ``routed_experts`` replayed (or measured) here; None: a dense model
        self.routing: RoutingReplay | None = None
        self.heads = HeadPassthrough(model) if head_is_plain(model) else None  # None: stats from full logits
        self.pack = pack
        if pack:
            enable_packing(model)
        self.sp: SequenceParallel | None = (
            None  # Ulysses context parallelism (set by the fsdp trainer; packed rows)
        )

    def __call__(self, batch: Batch, replay: bool | None = None) -> torch.Tensor:
        """``replay``: override the routing-replay setting for this forward (a batch with ``routed_experts``)."""
        with self._routing(batch, replay):
            return self._scaled(self._outputs(batch))

    def stats(
        self, batch: Batch, *, entropy: bool = True, sum_pi_squared: bool = False, replay: bool | None = None
    ) -> torch.Tensor:
        """(k, B, R) fp32: the response tokens' logprobs, then (as asked) their entropy and ``sum_v pi(v)^2``."""
        tokens = batch["responses"]
        with self._routing(batch, replay):
            if self.heads is None:  # logits transformed after the head: from the full logits
                return _full_stats(self._scaled(self._outputs(batch)), tokens, entropy, sum_pi_squared)
            kw = dict(
                temperature=self.temperature,
                chunk_tokens=self.chunk_tokens,
                entropy=entropy,
                sum_pi_squared=sum_pi_squared,
            )
            media = self._packed_media(batch)
            if media is not None:
                return self._packed_stats(batch, kw, media)
            if self.sp is not None:
                raise ValueError(
                    "trainer.backend_params.context_parallel: media rows and MoE routing replay run "
                    "the padded forward, which cannot be split over ranks; use context_parallel: 1"
                )
            with self.heads.hidden_out():
                hidden = self._outputs(batch)
            flat = chunked_token_stats(self.heads.head, hidden.flatten(0, 1), tokens.flatten(), **kw)
            return flat.view(-1, *tokens.shape)

    def _packed_media(self, batch: Batch) -> dict[str, Any] | None:
        """None: ``batch`` runs the padded forward (packing off, routing replayed per padded position, or media
        rows whose adapter gives no rope positions or that Ulysses would split); else its media keywords, packed."""
        if not self.pack or self._replays(batch):
            return None
        if not has_media(batch):
            return {}
        return None if self.sp is not None else packed_media_kwargs(self.model, batch)

    def _packed_stats(self, batch: Batch, kw: dict[str, Any], media: dict[str, Any]) -> torch.Tensor:
        packed, start, extra = pack_rows(batch), 0, media
        if self.sp is not None:  # Ulysses: this rank runs its slice of the packed tokens
            packed, start = self.sp.local(packed)
            extra = {"relax_sequence_parallel": self.sp}
        with self.heads.hidden_out():
            hidden = packed_forward(self.model, packed, **extra).logits[0]
        local = packed.targets - start
        valid = (packed.targets >= 0) & (local >= 0) & (local < hidden.shape[0])
        stats = chunked_token_stats(self.heads.head, hidden[local[valid]], batch["responses"][valid], **kw)
        out = stats.new_zeros((stats.shape[0], *packed.targets.shape))
        out[:, valid] = stats
        if self.sp is None:
            return out
        if (
            hidden.requires_grad
        ):  # a slice without response tokens still runs backward: its all-to-alls are collectives
            out = out + 0.0 * hidden.sum()
        return sum_over_ranks(out, self.sp)

    def _replays(self, batch: Batch) -> bool:
        return batch.get("routed_experts") is not None and self.routing is not None

    def _routing(self, batch: Batch, replay: bool | None) -> Any:
        if self._replays(batch):  # whole padded rows: the routing is per (row, position)
            return self.routing.applied(batch["routed_experts"], replay)
        return nullcontext()

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.temperature == 1.0 else logits / self.temperature

    def _outputs(self, batch: Batch) -> torch.Tensor:
        """The model's ``logits`` at the positions predicting the response tokens: (B, R, V), or (B, R, H)
        hidden states inside ``heads.hidden_out()``."""
        resp_len = batch["responses"].shape[1]
        media = has_media(batch)
        out = None if media or self._replays(batch) else self._shared_prompt_outputs(batch, resp_len)
        if out is None:
            kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            if media:
                ids, mask, width = (
                    batch["input_ids"],
                    batch["attention_mask"],
                    batch["input_ids"].shape[1] - resp_len,
                )
                kwargs = media_forward_kwargs(
                    self.model, ids, mask, unpack_media(batch), width, observed=batch.get("observation_mask")
                )
            out = self.model(use_cache=False, logits_to_keep=resp_len + 1, **kwargs).logits
            out = out[:, -(resp_len + 1) : -1]  # some models (Omni thinkers) ignore logits_to_keep
        return out

    def _shared_prompt_outputs(self, batch: Batch, resp_len: int) -> torch.Tensor | None:
        if not self.share_prompts or self.pack:  # packing replaces prompt sharing
            return None
        try:
            return shared_prefix_logits(self.model, batch, resp_len)
        except NotImplementedError:  # a cache whose rows cannot be repeated
            self.share_prompts = False
            return None


def _full_stats(
    logits: torch.Tensor, tokens: torch.Tensor, entropy: bool, sum_pi_squared: bool
) -> torch.Tensor:
    if sum_pi_squared:
        logprobs, sum_sq = logprobs_and_sum_pi_squared(logits, tokens)
    else:
        logprobs, sum_sq = logprobs_from_logits(logits, tokens), None
    out = [logprobs] + ([entropy_from_logits(logits.float())] if entropy else [])
    return torch.stack(out + ([sum_sq] if sum_sq is not None else []))


def score_rows(
    stats_fn: StatsFn,
    batch: Batch,
    micro_batch_size: int,
    sum_pi_squared: bool = False,
    *,
    max_tokens: int = 0,
    equalize: Callable[[int], int] | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """(B, R) fp32 logprobs of the responses, or with ``sum_pi_squared`` (B, 2, R) logprobs and
    ``sum_v pi(v)^2``; 0 where ``response_mask`` is 0; no grad, micro-batched (rows, or tokens with
    ``max_tokens``); a CPU tensor."""
    pieces = []
    with torch.no_grad():
        for sub in micro_batches(batch, micro_batch_size, max_tokens, packed, equalize):
            stats = stats_fn(sub, entropy=False, sum_pi_squared=sum_pi_squared)
            pieces.append((sub, torch.where(sub["response_mask"] > 0, stats, torch.zeros_like(stats))))
    if max_tokens:  # token-budget micro-batches: rows back in the batch's order, each stat on its own
        shape = batch["responses"].shape
        out = torch.stack(
            [scatter_rows([(m, p[i]) for m, p in pieces], *shape) for i in range(pieces[0][1].shape[0])]
        )
    else:
        out = torch.cat([p for _, p in pieces], dim=1)
    return (out.transpose(0, 1) if sum_pi_squared else out[0]).cpu()


def forward_backward(
    stats_fn: StatsFn, micro_batches: Sequence[Batch], loss_fn: LossFn
) -> list[dict[str, float]]:
    """``ModelStep.forward_backward`` for an HF model: fp32 logprobs and entropy of each micro-batch
    (with grad), ``loss_fn``, backward (gradients accumulate); the records in order."""
    records = []
    for sub in micro_batches:
        logprobs, entropy = stats_fn(sub, entropy=True)
        loss, record = loss_fn(sub, logprobs, entropy)
        loss.backward()
        records.append(record)
    return records
