"""Simulated cluster for ``bench/async_overlap.py`` (a plugin, not a benchmark): a Relax plugin whose engine and trainer only sleep.

Loaded through ``RELAX_PLUGINS=sim_plugin`` so the real controller, queue, router, staleness gate
and weight sync run unchanged; only the compute is replaced by sleeps (no model).

Engine: continuous batching with ``slots`` concurrent sequences; a response of L tokens occupies a
slot for ``L * token_s`` seconds; L is log-normal (long tail), drawn from the request's seed.
Trainer: forward and train steps sleep in proportion to the batch's response tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from relax.core.hookspecs import hookimpl
from relax.core.protocols import GenerationResult

CHUNK_TOKENS = 16  # pause/abort/version granularity


@dataclass(frozen=True)
class SimEngineParams:
    slots: int = 32  # concurrent sequences
    token_s: float = 0.001  # seconds per generated token
    mean_len: float = 150.0
    sigma: float = 1.0  # log-normal spread of response lengths
    max_len: int = 2000


@dataclass(frozen=True)
class SimTrainerParams:
    train_token_s: float = 4e-5
    forward_token_s: float = 1e-5


class SimEngine:
    def __init__(self, p: SimEngineParams, ctx: Any = None) -> None:
        self.slots = threading.BoundedSemaphore(p.slots)
        self.token_s, self.sigma, self.max_len = p.token_s, p.sigma, p.max_len
        self.mu = math.log(p.mean_len) - self.sigma**2 / 2  # so that E[L] = mean_len
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0

    def _length(self, seed: int | None) -> int:
        return max(1, min(self.max_len, int(random.Random(seed).lognormvariate(self.mu, self.sigma))))

    async def _one(self, request: Any) -> GenerationResult:
        await asyncio.to_thread(self.slots.acquire)
        try:
            epoch, length, versions = self._abort_epoch, self._length(request.params.seed), []
            while len(versions) < length:
                while not self._running.is_set():
                    await asyncio.sleep(0.002)
                if self._abort_epoch != epoch:
                    return GenerationResult(
                        request.request_id, [1] * len(versions), [0.0] * len(versions), versions, "abort"
                    )
                n = min(CHUNK_TOKENS, length - len(versions))
                await asyncio.sleep(n * self.token_s)
                versions += [self._version] * n
            return GenerationResult(
                request.request_id, [1] * length, [-1.0] * length, versions, "stop", text="1"
            )
        finally:
            self.slots.release()

    async def generate(self, requests: list[Any]) -> list[GenerationResult]:
        return list(await asyncio.gather(*[self._one(r) for r in requests]))

    def update_weights(self, named_tensors: Any, version: int) -> None:
        list(named_tensors)
        self._version = version

    def weight_version(self) -> int:
        return self._version

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def abort(self) -> None:
        self._abort_epoch += 1

    def health(self) -> dict[str, Any]:
        return {"ok": True, "weight_version": self._version}


class SimTrainer:
    def __init__(self, p: SimTrainerParams, ctx: Any = None) -> None:
        self.train_token_s, self.forward_token_s = p.train_token_s, p.forward_token_s
        self.weight = torch.zeros(1024)

    def _tokens(self, batch: dict[str, torch.Tensor]) -> float:
        return float(batch["response_mask"].sum())

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(self._tokens(batch) * self.forward_token_s)
        return torch.full(batch["response_mask"].shape, -1.0)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        time.sleep(self._tokens(batch) * self.train_token_s)
        self.weight += 1
        return {"loss": 0.0, "grad_norm": 0.0}

    def export_weights(self, bucket_bytes: int = 0):
        yield [("w", self.weight.clone())]

    def save(self, directory: str) -> None:
        import pathlib

        pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(self.weight, f"{directory}/w.pt")

    def load(self, directory: str) -> None:
        self.weight = torch.load(f"{directory}/w.pt")

    def save_hf(self, directory: str) -> None:
        self.save(directory)


class SimReward:
    async def score(self, sample: Any) -> float:
        return float(sample.group_id % 2)


@hookimpl
def relax_register_rollout_engines(register):
    register("sim", SimEngine, config=SimEngineParams)


@hookimpl
def relax_register_trainers(register):
    register("sim", SimTrainer, config=SimTrainerParams)


@hookimpl
def relax_register_rewards(register):
    register("sim", lambda params, ctx: SimReward())
