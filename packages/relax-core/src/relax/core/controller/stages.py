"""Per-step stages shared by every mode: rollout, reward, logprobs, advantages, train, sync.

Each stage is a small function over Ray handles and plain data so that the colocate loop and the
async/hybrid roles compose the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import ray
import torch

from relax.core.algorithms import AdvantageInputs, compute_advantages, get_kl_estimator
from relax.core.config import RelaxConfig
from relax.core.controller.samples import apply_result, request_for, sampling_params
from relax.core.data import Sample, collate
from relax.core.plugins import get_plugin_manager


@contextmanager
def timed(metrics: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    metrics[f"time/{name}_s"] = metrics.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


def generate(
    engines: list[Any],
    groups: list[list[Sample]],
    cfg: RelaxConfig,
    step: int,
    stop_token_ids: list[int],
    on_progress: Callable[[int], None] | None = None,
    timeout_s: float = 600.0,
) -> list[list[Sample]]:
    """Spread every sample of every group over the engines (round robin chunks) and fill responses."""
    params = sampling_params(cfg, stop_token_ids)
    flat = [s for g in groups for s in g]
    n_chunks = max(len(engines), min(len(flat), 4 * len(engines)))
    chunks = [flat[i::n_chunks] for i in range(n_chunks)]
    pending = {}
    for i, chunk in enumerate(chunks):
        if chunk:
            ref = engines[i % len(engines)].generate.remote([request_for(s, params, cfg.seed, step) for s in chunk])
            pending[ref] = chunk
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"rollout: {len(pending)} generate calls did not finish within {timeout_s:.0f}s")
        ref = ready[0]
        chunk = pending.pop(ref)
        for sample, result in zip(chunk, ray.get(ref), strict=True):
            apply_result(sample, result)
        if on_progress:
            on_progress(len(chunk))
    return groups


def filter_groups(groups: list[list[Sample]]) -> tuple[list[list[Sample]], int]:
    """Apply ``relax_filter_group`` hooks; returns kept groups and the number dropped."""
    hook = get_plugin_manager().hook.relax_filter_group
    kept = [g for g in groups if False not in hook(group=g)]
    return kept, len(groups) - len(kept)


def prepare_batch(
    samples: list[Sample],
    pad_id: int,
    cfg: RelaxConfig,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Collate, attach old/ref logprobs and advantages; return the batch and advantage metrics."""
    batch = collate(samples, pad_id)
    mask = batch["response_mask"]
    batch["old_logprobs"] = old_logprobs
    if ref_logprobs is not None:
        batch["ref_logprobs"] = ref_logprobs
    rewards = batch["rewards"]
    kl_coef = cfg.algorithm.kl.coef if cfg.algorithm.kl.use == "reward" else 0.0
    inputs = AdvantageInputs(
        rewards=rewards,
        response_mask=mask,
        index=batch["group_index"],
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
    )
    advantages, returns = compute_advantages(cfg.algorithm, inputs)
    batch["advantages"] = advantages
    batch["returns"] = returns
    metrics: dict[str, float] = {}
    tokens = mask.sum().clamp(min=1)
    metrics["adv/mean"] = float((advantages * mask).sum() / tokens)
    metrics["rollout/train_logprob_abs_diff"] = float(((batch["rollout_logprobs"] - old_logprobs).abs() * mask).sum() / tokens)
    if ref_logprobs is not None:
        kl = get_kl_estimator(cfg.algorithm.kl.estimator)(old_logprobs, ref_logprobs)
        metrics["kl/policy_ref"] = float((kl * mask).sum() / tokens)
    return batch, metrics


def sample_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    correct = torch.tensor([float(s.reward_info.get("acc", float((s.reward or 0.0) >= 1.0))) for s in samples])
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/accuracy": float(correct.mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
