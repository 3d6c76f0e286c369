"""Ray actor wrappers around the plugin objects. Each role builds its object from config by name.

The wrappers stay thin on purpose: the objects behind them (engine, trainer, reward) are plain
Python implementing the Protocols, so they are unit-testable without Ray. What a step does with
their answers (reward shaping, advantages) is the stages' business (``controller.stages``); where
each role runs is decided by ``controller.hosting``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from relax.core import lazy_ray
from relax.core.config import RelaxConfig
from relax.core.context import PluginContext
from relax.core.controller.capabilities import capabilities
from relax.core.controller.closing import close_held
from relax.core.controller.collective import CollectiveExport, drain, is_collective
from relax.core.controller.contexts import build_plugin, plugin_params
from relax.core.data import Sample
from relax.core.policy_update.memory import onloaded, release
from relax.core.protocols import GenerationRequest, GenerationResult
from relax.core.weight_sync import serve_receiver, serve_sender


def _limit_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)


@lazy_ray.remote
class RolloutRole:
    """Hosts one rollout engine. Threaded so ``pause``/``health`` answer while ``generate`` runs."""

    def __init__(self, cfg: RelaxConfig, ctx: PluginContext, num_threads: int | None = None):
        _limit_threads(num_threads)
        self.engine = build_plugin(cfg, "rollout_engine", ctx)
        self.engine_index = ctx.index

    def capabilities(self) -> list[str]:
        return capabilities(self.engine)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return asyncio.run(self.engine.generate(requests))

    def update_weights(self, named_tensors: Any, version: int) -> int:
        self.engine.update_weights(named_tensors, version)
        return self.engine.weight_version()

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def weight_receiver(self, spec: Any, method: str, *args: Any) -> Any:
        """Weight-sync endpoint: the transport's receiver for this engine (built once per transport)."""
        return serve_receiver(self, self.engine, spec, method, *args)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def abort(self) -> None:
        """Optional capability, checked at start-up when the config needs it."""
        self.engine.abort()

    def release_memory(self) -> None:
        """Optional capability (``rollout.release_memory``), as ``abort``."""
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def health(self) -> dict[str, Any]:
        return {"engine_index": self.engine_index, **self.engine.health()}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Any engine method, for inspection in tests and tools (e.g. ``state_dict``); the controller
        only calls the explicit methods above."""
        return getattr(self.engine, method)(*args, **kwargs)

    def close(self) -> None:
        """End of run: the engine's ``close()`` and this process's weight-sync sides (controller.closing)."""
        close_held(self, self.engine)


@lazy_ray.remote
class TrainerRole:
    """Hosts the policy trainer (and its critic, if any), or with ``reference=True`` a frozen model:
    the KL reference, or a distillation teacher when ``model_path`` is the teacher's.

    With ``trainer.resources.num_workers > 1`` every rank is a ``TrainerRole`` and rank 0 leads
    (``lead``): the training-state methods below run on all ranks and answer with rank 0's result;
    weight export, weight-sync endpoints, ``capabilities`` and ``call`` run on rank 0 only, except that
    a trainer declaring ``collective_export`` has every peer drain its own export in step with rank 0's
    (``relax.core.controller.collective``).
    """

    def __init__(self, cfg: RelaxConfig, ctx: PluginContext, num_threads: int | None = None):
        _limit_threads(num_threads)
        self.trainer = build_plugin(cfg, "trainer", ctx)
        self.model_path = ctx.model_path
        self.peers = None  # WorkerGroup of ranks 1.. when this actor is rank 0 of a worker group
        self._fan_out = threading.Lock()  # one fan-out at a time: every rank sees the calls in one order

    def lead(self, peers: Any) -> None:
        self.peers = peers

    def _all(self, method: str, *args: Any) -> Any:
        """``trainer.method(*args)`` here and on every peer rank; this rank's (rank 0's) result."""
        fn = getattr(self.trainer, method)
        if self.peers is None:
            return fn(*args)
        with self._fan_out:
            return self.peers.run(method, *args, local=lambda: fn(*args))

    def capabilities(self) -> list[str]:
        return capabilities(self.trainer)

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._all("forward_logprobs", batch)

    def forward_logprobs_and_sum_pi_squared(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Optional capability, checked at start-up when an algorithm declares ``sum_pi_squared``."""
        return self._all("forward_logprobs_and_sum_pi_squared", batch)

    def forward_reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """LoRA: the reference policy's logprobs, the base with the adapters disabled (``controller.reference``)."""
        return self._all("forward_reference_logprobs", batch)

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Critic values (PPO); the trainer must have been built with a critic."""
        return self._all("forward_values", batch)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._all("train_step", batch)

    def offload(self, parts: tuple[str, ...] = ()) -> dict[str, Any]:
        """Colocate (``controller.handoff``): every rank frees its allocator's cache and, with ``trainer.offload``,
        moves ``parts`` of its state to host memory (any trainer can do the first); rank 0's memory before/after."""
        if self.peers is None:
            return release(self.trainer, parts)
        with self._fan_out:
            return self.peers.run("offload", parts, local=lambda: release(self.trainer, parts))

    def onload(self) -> dict[str, Any]:
        """``trainer.offload``: every rank's state back on its device before training."""
        return self._all("onload")

    def _exporter(self) -> Any:
        """The trainer as an exporter sees it: itself, or on rank 0 of a collective export, a view whose
        ``export_weights`` runs on every rank together."""
        if self.peers is None or not is_collective(self.trainer):
            return self.trainer
        return CollectiveExport(self.trainer, self.peers, self._fan_out)

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Streams buckets (a Ray generator: one object per bucket, never the whole model at once). An offloaded
        trainer (``trainer.offload``: a replacement engine synced between steps) exports from the device."""
        with onloaded(self.trainer):
            yield from self._exporter().export_weights(bucket_bytes)

    def drain_export(self, bucket_bytes: int) -> int:
        """A peer rank's share of a collective export (called by rank 0); the number of buckets."""
        with onloaded(self.trainer):
            return drain(self.trainer, bucket_bytes)

    def weight_sender(self, spec: Any, method: str, *args: Any) -> Iterator[Any]:
        """Weight-sync endpoint: the transport's sender in this process (``push`` streams progress)."""
        with onloaded(self.trainer):
            yield from serve_sender(self, self._exporter(), spec, method, *args)

    def save(self, directory: str) -> None:
        with onloaded(self.trainer):  # trainer.offload: a checkpoint sees the state on the device
            self._all("save", directory)

    def load(self, directory: str) -> None:
        with onloaded(self.trainer):  # trainer.offload: a checkpoint sees the state on the device
            self._all("load", directory)

    def save_hf(self, directory: str) -> None:
        """The trainer's HF directory, in the layout of the checkpoint the run started from (a whole
        Qwen-Omni checkpoint comes back whole: ``multimodal_model.restore_layout``)."""
        from relax.core.multimodal_model import restore_layout

        with onloaded(self.trainer):
            self._all("save_hf", directory)
        if self.model_path is not None:
            restore_layout(directory, self.model_path)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.trainer, method)(*args, **kwargs)

    def close(self) -> None:
        """End of run: the trainer's (and a hosted engine's) ``close()`` and this process's weight-sync sides."""
        close_held(self, self.trainer, getattr(self, "engine", None))


@lazy_ray.remote
class RewardRole:
    """Scores samples concurrently with a per-sample timeout (see ``relax.core.rewards.runner``).
    Scoring runs on a loop that is never closed, so an abandoned (timed-out) call never blocks.
    Reward shaping (DAPO overlong penalty) is applied by ``stages.score``, wherever this role runs."""

    def __init__(self, cfg: RelaxConfig, ctx: PluginContext):
        from relax.core.rewards.runner import ScoringLoop

        self.reward = build_plugin(cfg, "reward", ctx)
        self.cfg = cfg.reward
        self.name = cfg.reward.name
        self.engine_handle = ctx.engine_handle
        self.loop = ScoringLoop()

    def capabilities(self) -> list[str]:
        return capabilities(self.reward)

    def set_engines(self, engines: list[Any]) -> None:
        """The live rollout engines (after a replacement), for ``ctx.engine_handle()``."""
        if hasattr(self.engine_handle, "engines"):
            self.engine_handle.engines = list(engines)

    def score(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        c = self.cfg
        stats = self.loop.score(
            self.reward,
            samples,
            timeout_s=c.timeout_s,
            max_concurrency=c.max_concurrency,
            on_error=c.on_error,
            reward_name=self.name,
            fallback_score=c.fallback_score,
        )
        return samples, {
            "failures": float(stats.failures),
            "timeouts": float(stats.timeouts),
            "seconds": stats.seconds,
        }

    def close(self) -> None:
        """End of run: the reward's ``close()`` (pools, sessions; controller.closing)."""
        close_held(self, self.reward)


_Trainer = TrainerRole.__ray_actor_class__
_Rollout = RolloutRole.__ray_actor_class__


class _Host(_Trainer):
    """A ``TrainerRole`` that is also the run's rollout engine (engine methods as ``RolloutRole``'s):
    ``rollout.host`` trainer or driver (``controller.hosting``). The engine is
    :class:`relax.core.engines.hosted.HostedHFEngine` over the trainer's module, so the router, the
    fleet and the weight sync (:class:`relax.core.weight_sync.hosted.HostedSync`: publish the
    version, move nothing) reach it through the ordinary engine handle."""

    def __init__(
        self, cfg: RelaxConfig, ctx: PluginContext, engine_ctx: PluginContext, num_threads: int | None = None
    ):
        from relax.core.engines.hosted import hosted_engine

        super().__init__(cfg, ctx, num_threads=num_threads)
        self.engine = hosted_engine(self.trainer, plugin_params(cfg, "rollout_engine"), engine_ctx)
        self.engine_index = engine_ctx.index

    generate = _Rollout.generate
    update_weights = _Rollout.update_weights
    weight_version = _Rollout.weight_version
    weight_receiver = _Rollout.weight_receiver
    pause = _Rollout.pause
    resume = _Rollout.resume
    abort = _Rollout.abort
    release_memory = _Rollout.release_memory
    resume_memory = _Rollout.resume_memory
    health = _Rollout.health

    def capabilities(self) -> list[str]:
        """Both roles' optional methods (each start-up check looks for its own names)."""
        return sorted({*capabilities(self.trainer), *capabilities(self.engine)})

    def publish_version(self, version: int) -> int:
        """``HostedSync``'s endpoint: the weights as they are now are ``version``."""
        self.engine.end_weight_update(version)
        return self.engine.weight_version()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A trainer method, else an engine method (inspection in tests and tools)."""
        target = self.trainer if hasattr(self.trainer, method) else self.engine
        return getattr(target, method)(*args, **kwargs)


HostRole = lazy_ray.remote(_Host)
