"""Per-token logprobs and entropy from hidden states, a chunk of tokens at a time.

Full logits are ``tokens x V`` floats: at 8K response tokens and Qwen3's V = 151,936 that is ~4.9 GB
of fp32 per row, more than the model's own activations. Here the output head runs on a chunk of
hidden states at a time and each chunk's logits are dropped as soon as its logprobs and entropy
exist; with grad, each chunk is recomputed in backward (``torch.utils.checkpoint``), so only the
chunk's hidden states are kept. Values equal the full-logits path's; gradients too (same ops).

The hidden states come from the model's own forward: :class:`HeadPassthrough` hooks the model's
output head so that, inside :meth:`HeadPassthrough.hidden_out`, the head sees zero positions (it
computes nothing) and returns its input as the model's logits. Thread-local, so a concurrent forward of the same module (a hosting actor's
old- and reference-logprob passes) is untouched. Nothing about the model family is assumed beyond
HF's ``get_output_embeddings()``; models that transform logits after the head (soft-capping, a logit
scale) are refused (:func:`head_is_plain`) and keep the full-logits path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

#: config attributes of models whose logits are not just ``head(hidden)``
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def head_is_plain(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are exactly its output head applied to its last hidden states."""
    config = getattr(model, "config", None)
    nested = [v for v in vars(config).values() if hasattr(v, "to_dict")] if config is not None else []
    present = [config, *nested] if config is not None else []  # a composite model's sub-configs (text, ...)
    transformed = any(getattr(c, a, None) not in (None, 1, 1.0) for c in present for a in _LOGIT_TRANSFORMS)
    return not transformed and model.get_output_embeddings() is not None


class HeadPassthrough:
    """``model``'s output head made a pass-through inside :meth:`hidden_out`: the head computes nothing
    and returns its input, so the model's ``logits`` are its last hidden states (see the module doc).
    They stay the model's own output, so a wrapper that hooks the outputs (FSDP's backward) sees them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.head = model.get_output_embeddings()
        self._local = threading.local()
        self.head.register_forward_pre_hook(self._skip)
        self.head.register_forward_hook(self._pass)

    def _skip(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not getattr(self._local, "active", False):
            return None
        self._local.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])  # zero positions: the head computes nothing

    def _pass(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not getattr(self._local, "active", False):
            return None
        hidden, self._local.hidden = self._local.hidden, None
        return hidden

    @contextmanager
    def hidden_out(self) -> Iterator[None]:
        """Inside, on this thread, the model's ``logits`` are the head's inputs."""
        self._local.active = True
        try:
            yield
        finally:
            self._local.active = False


def _chunk_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    entropy: bool,
    sum_pi_squared: bool,
) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(dim=-1)
    out = [logits.gather(-1, tokens[:, None]).squeeze(-1) - lse]
    if entropy:  # H = lse - sum softmax(z) z (as algorithms.entropy_from_logits)
        out.append(lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1))
    if sum_pi_squared:  # as algorithms.logprobs_and_sum_pi_squared
        out.append((logits - lse[:, None]).mul_(2.0).exp_().sum(dim=-1))
    return torch.stack(out)


def chunked_token_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy: bool = True,
    sum_pi_squared: bool = False,
) -> torch.Tensor:
    """(k, N) fp32 stats of ``tokens`` (N,) under ``head(hidden)`` (hidden (N, H)) divided by ``temperature``:
    row 0 logprobs, then entropy and/or ``sum_v pi(v)^2`` as asked. ``chunk_tokens`` 0: one chunk."""
    n = hidden.shape[0]
    size = chunk_tokens if chunk_tokens > 0 else max(n, 1)
    recompute = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts = []
    for start in range(
        0, max(n, 1), size
    ):  # no tokens: one empty chunk, so the head is in the graph all the same
        args = (
            head,
            hidden[start : start + size],
            tokens[start : start + size],
            temperature,
            entropy,
            sum_pi_squared,
        )
        parts.append(
            checkpoint(_chunk_stats, *args, use_reentrant=False)
            if recompute and n > size
            else _chunk_stats(*args)
        )
    return torch.cat(parts, dim=1)
