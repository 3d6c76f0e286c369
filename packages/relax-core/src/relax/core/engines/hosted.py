"""Trainer-hosted HF engine: rollout served by the trainer's own module, in the trainer's process.

In local colocate runs (one trainer rank, one built-in HF engine on the same device) a separate
engine process costs a second torch import, a second model copy and a weight transfer per step.
Hosted, the engine decodes with the trainer's ``nn.Module`` itself: there is nothing to transfer,
so a "weight sync" only publishes the next version number (:class:`HostedSync`).

Versions stay checked as with every transport: the engine fingerprints the weights it serves
(each parameter's storage and in-place version counter, which every optimizer step, ``copy_`` or
``load_state_dict`` bumps) when a version is published, and ``generate`` refuses to sample from
weights that changed after that -- a train step whose version was never published (a missed
sync) is an error naming both versions, never silently-mislabelled samples.

Generation runs under ``no_grad`` in eval mode (the mode the trainer was in is restored once the
last call ends), and the decode batch and kept prefills are released when no call is in flight,
so no KV cache stays allocated while the trainer trains.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from relax.core.engines.batcher import DecodeBatch
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, GenerationResult


class StaleWeightsError(RuntimeError):
    """The trainer's weights changed since the last published version (a weight sync was missed)."""


def fingerprint(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Which tensors hold the weights and how often each was written in place (cheap: no data read)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class HostedHFEngine(HFRolloutEngine):
    """``RolloutEngine`` over a module it does not own (the trainer's); see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        model_path: str = "",
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        prefix_cache_mb: float = 0.0,
        record_routing: bool = False,
    ) -> None:
        # kept KV (prefix_cache_mb) names its weight version: a published version makes it stale at once
        super().__init__(
            model_path,
            device=device,
            max_batch_size=max_batch_size,
            seed=seed,
            model=model,
            tokenizer=tokenizer,
            prefix_cache_mb=prefix_cache_mb,
            record_routing=record_routing,
        )
        self._published = fingerprint(model)
        self._mode_lock = threading.Lock()
        self._calls = 0
        self._was_training = False

    # ------------------------------------------------------------------ versions
    def update_weights(self, named_tensors: Any, version: int) -> None:
        raise StaleWeightsError(
            "the trainer-hosted engine serves the trainer's own weights: nothing to copy. Its weight sync "
            "only publishes the version (engines.hosted.HostedSync); set rollout.host=separate for a transport"
        )

    def end_weight_update(self, version: int) -> None:
        """Publish ``version``: the weights as they are now are the ones it names."""
        with self._step_lock:
            self._published = fingerprint(self.model)
            self._version = version
            self._prefixes.clear()  # kept prefills are of the previous weights

    def check_published(self) -> None:
        if fingerprint(self.model) != self._published:
            raise StaleWeightsError(
                f"trainer-hosted engine: the trainer's weights changed after version {self._version} was "
                "published and no newer version was (a missed weight sync); refusing to label samples "
                f"with version {self._version}"
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the served (live) weights, by HF name."""
        with self._step_lock:
            return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    # ------------------------------------------------------------------ generation
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self.check_published()
        self._enter()
        try:
            return await super().generate(requests)
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._mode_lock:
            if self._calls == 0:
                self._was_training = self.model.training
                self.model.eval()
            self._calls += 1

    def _leave(self) -> None:
        with self._mode_lock:
            self._calls -= 1
            if self._calls:
                return
            with self._step_lock:  # free the KV cache before the trainer needs the memory
                self._batch = DecodeBatch(self.device)
                if not self._waiting:
                    self._prefixes.clear()
            self.model.train(self._was_training)


def hosted_engine(trainer: Any, params: Any, ctx: Any) -> HostedHFEngine:
    """The hosted engine for ``trainer`` (needs ``.model`` and ``.tokenizer``, as ``TorchTrainer`` has),
    with the ``hf`` engine's typed ``params`` (``max_batch_size``, ``seed``, ``prefix_cache_mb``)."""
    model, tokenizer = getattr(trainer, "model", None), getattr(trainer, "tokenizer", None)
    if not isinstance(model, torch.nn.Module) or tokenizer is None:
        raise TypeError(
            f"rollout.host=trainer: trainer {type(trainer).__name__} has no HF .model/.tokenizer to serve"
        )
    device = str(next(model.parameters()).device)
    return HostedHFEngine(
        model,
        tokenizer,
        model_path=ctx.model_path or "",
        device=device,
        max_batch_size=params.max_batch_size,
        seed=params.seed,
        prefix_cache_mb=params.prefix_cache_mb,
        record_routing=getattr(ctx, "record_routing", False),
    )  # MoE routing replay
