"""Interfaces between roles (typing.Protocol; implementations never inherit from these).

Shapes follow one convention everywhere: a batch is prompts left-padded to P plus responses
right-padded to R; per-token tensors (logprobs, masks, advantages) are (B, R) over response tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens unless a stop id/string matches


@dataclass
class GenerationRequest:
    """One prompt to complete once (n samples per prompt = n requests)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # tokens already generated for this request (partial rollout resumes from here)
    prefix_response_ids: list[int] = field(default_factory=list)
    prefix_logprobs: list[float] = field(default_factory=list)
    prefix_versions: list[int] = field(default_factory=list)
    # processed media inputs of the prompt (``ProcessedPrompt["inputs"]``): an object-store reference or
    # the dict itself, the same object for every request of a group (resolved once by the engine)
    media: Any = None


@dataclass
class GenerationResult:
    request_id: str
    response_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution used
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""


@runtime_checkable
class RolloutEngine(Protocol):
    """Every method the controller calls on an engine. Optional capabilities are separate
    protocols below; they are detected by method presence and checked at start-up
    (``relax.core.controller.capabilities``)."""

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def weight_version(self) -> int: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


@runtime_checkable
class Trainer(Protocol):
    """Every method the controller calls on a trainer (policy, reference or teacher)."""

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) log-probs of the response tokens under the current weights, no grad."""
        ...

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step (micro-batched internally) on a collated batch; returns metrics."""
        ...

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[NamedTensors]:
        """HF-named tensors, grouped into buckets of roughly ``bucket_bytes``.

        A sharded trainer whose export gathers across its ranks (a collective) declares the class
        attribute ``collective_export = True``: in a worker group, every rank then iterates its own
        ``export_weights(bucket_bytes)`` in lockstep with rank 0 and only rank 0's buckets are sent
        (``relax.core.controller.collective``). Without it, only rank 0 exports."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


# ---------------------------------------------------------------- optional capabilities


@runtime_checkable
class SupportsAbort(Protocol):
    def abort(self) -> None:
        """End every in-flight request now with finish reason ``"abort"`` (they are resubmitted)."""
        ...


@runtime_checkable
class SupportsReleaseMemory(Protocol):
    """Engines that can free their accelerator memory between rollouts (``rollout.release_memory``, colocate):
    called after the step's rollout, with nothing in flight; ``resume_memory`` comes before the weight sync,
    which then writes the new weights (an engine may drop its weights on release)."""

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


@runtime_checkable
class SupportsWeightUpdateBracket(Protocol):
    """Engines that must prepare for and finish a weight update (e.g. SGLang); every transport calls
    ``begin_weight_update`` before its first bucket and ``end_weight_update`` after its last."""

    def begin_weight_update(self, version: int) -> None: ...

    def end_weight_update(self, version: int) -> None: ...


@runtime_checkable
class SupportsValues(Protocol):
    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) critic values of the response tokens (PPO, ``algorithm.critic.enable``)."""
        ...


@runtime_checkable
class SupportsSumPiSquared(Protocol):
    def forward_logprobs_and_sum_pi_squared(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs(batch)`` and, from the same forward, the (B, R) fp32 per-token sum over
        the vocabulary of squared probabilities of the same (temperature-scaled) policy, 0 where
        masked; called only when a chosen algorithm declares ``sum_pi_squared`` (optimal token
        baselines)."""
        ...


@runtime_checkable
class SupportsSaveHF(Protocol):
    def save_hf(self, directory: str) -> None:
        """Write the model in HF format (``checkpoint.save_hf_final``, ``relax convert``)."""
        ...


@runtime_checkable
class SupportsGroupScoring(Protocol):
    async def score_group(self, samples: list[Any]) -> list[float | dict[str, float]]:
        """Score all responses to one prompt at once (pairwise judges, group-relative rewards)."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        """Move the trainer's weights to every engine as ``version``; return stats (seconds, bytes).

        Raises ``WeightSyncError`` naming the engine if one does not acknowledge in time.
        """
        ...

    def check_engine(self, engine: str) -> None:
        """Start-up check: raise ``WeightSyncError`` naming both if this transport cannot serve the
        registered rollout engine ``engine``."""
        ...


@runtime_checkable
class Reward(Protocol):
    async def score(self, sample: Any) -> float | dict[str, float]:
        """Score one sample; a dict must contain ``"score"`` (the training reward)."""
        ...


@runtime_checkable
class Processor(Protocol):
    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Turn a (multimodal) chat message list into model inputs."""
        ...
