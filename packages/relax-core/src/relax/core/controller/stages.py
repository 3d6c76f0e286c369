"""Per-step stages shared by every mode: rollout, reward, logprobs, advantages, train, sync.

Each stage is a small function over Ray handles and plain data so that the colocate loop and the
async/hybrid roles compose the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from relax.core.algorithms import (
    AdvantageInputs,
    compute_advantages,
    config_needs,
    dynamic_sampling_keep,
    get_kl_estimator,
    mismatch_metrics,
    overlong_penalty,
)
from relax.core.config import RelaxConfig
from relax.core.controller import faults
from relax.core.controller.hosting import hosts_engine
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.controller.samples import sampling_params
from relax.core.data import Sample, collate
from relax.core.plugins import get_plugin_manager
from relax.core.protocols import SamplingParams


@contextmanager
def timed(metrics: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    metrics[f"time/{name}_s"] = metrics.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


def train_metrics(values: dict[str, Any]) -> dict[str, float]:
    """A train step's metrics under ``train/``; the trainer's own ``perf/*`` (memory, micro-batches,
    padding) keep their names, beside the run's other ``perf/*``."""
    return {k if k.startswith("perf/") else f"train/{k}": float(v) for k, v in values.items()}


@contextmanager
def engine_memory_released(fleet: Any, cfg: RelaxConfig, metrics: dict[str, float]):
    """``rollout.release_memory`` (colocate): every serving engine frees its accelerator memory for the
    block (the training) and takes it back after it, before the weight sync -- also when the block fails,
    so a recovered run's next rollout finds its engines whole."""
    if not cfg.rollout.release_memory:
        yield
        return
    with timed(metrics, "release_memory"):
        released = fleet.control("release_memory")
    try:
        yield
    finally:
        with timed(metrics, "resume_memory"):
            live = fleet.router.live()
            fleet.control("resume_memory", engines={i: live[i] for i in released if i in live})


def generate(
    router: EngineRouter | list[Any],
    groups: list[list[Sample]],
    cfg: RelaxConfig,
    step: int,
    stop_token_ids: list[int],
    on_progress: Callable[[int], None] | None = None,
    params: SamplingParams | None = None,
    turns: Any = None,
) -> list[list[Sample]]:
    """Fill every sample's response through the same router the async producer uses (a list of
    engine handles gets a router of its own). Each generate call is bounded by ``rollout.timeout_s``.

    ``params`` overrides the sampling parameters from ``cfg.rollout`` (e.g. greedy probes); ``turns``
    makes every sample a multi-turn episode (``relax.core.agentic.Turns``)."""
    params = params or sampling_params(cfg, stop_token_ids)
    if not isinstance(router, EngineRouter):
        router = EngineRouter(router)
    for finished, _ in stream_groups(
        router, groups, params, cfg.seed, step, timeout_s=cfg.rollout.timeout_s, turns=turns
    ):
        if on_progress:
            on_progress(sum(len(g) for g in finished))
    return groups


def score(reward: Any, samples: list[Sample], cfg: RelaxConfig) -> tuple[list[Sample], dict[str, float]]:
    """Score through the reward role, bounded by :func:`relax.core.controller.faults.reward_timeout`,
    then shape the rewards (:func:`shape_rewards`): every mode scores through here, wherever the
    reward role runs (its own actor, or the driver)."""
    scored, stats = faults.wait(
        reward.score.remote(samples), faults.reward_timeout(cfg, len(samples)), "reward", "score"
    )
    shape_rewards(scored, cfg)
    return scored, stats


def filter_groups(
    groups: list[list[Sample]], cfg: RelaxConfig | None = None
) -> tuple[list[list[Sample]], int]:
    """Apply ``relax_filter_group`` hooks, then (given ``cfg`` with ``algorithm.dynamic_sampling``
    on) DAPO's uniform-reward filter; returns kept groups and the number dropped."""
    hook = get_plugin_manager().hook.relax_filter_group
    kept = [g for g in groups if False not in hook(group=g)]
    if cfg is not None and cfg.algorithm.dynamic_sampling.enable:
        kept, _ = drop_uniform_groups(kept, cfg.algorithm.dynamic_sampling.metric)
    return kept, len(groups) - len(kept)


def _metric_value(sample: Sample, metric: str) -> float:
    if metric == "reward":
        return float(sample.reward or 0.0)
    if metric not in sample.reward_info:
        raise KeyError(
            f"algorithm.dynamic_sampling.metric: reward_info has no {metric!r}; "
            f"available: reward, {', '.join(sorted(sample.reward_info))}"
        )
    return float(sample.reward_info[metric])


def drop_uniform_groups(groups: list[list[Sample]], metric: str = "score") -> tuple[list[list[Sample]], int]:
    """DAPO dynamic sampling: keep groups whose ``metric`` (a ``reward_info`` key, or "reward" for
    the final shaped reward) differs between members; returns kept groups and the number dropped."""
    if not groups:
        return [], 0
    values = torch.tensor([_metric_value(s, metric) for g in groups for s in g], dtype=torch.float64)
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    keep = dynamic_sampling_keep(values, index)
    starts = torch.tensor([0, *[len(g) for g in groups]]).cumsum(0)[:-1]
    kept = [g for g, start in zip(groups, starts.tolist(), strict=True) if g and bool(keep[start])]
    return kept, len(groups) - len(kept)


def shape_rewards(samples: list[Sample], cfg: RelaxConfig) -> None:
    """Add DAPO's soft overlong penalty (``algorithm.overlong``) to ``sample.reward`` in place and
    record it in ``reward_info["overlong_penalty"]``; ``reward_info["score"]`` keeps the task score."""
    ov = cfg.algorithm.overlong
    if ov.buffer <= 0 or not samples:
        return
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, ov.buffer, ov.penalty_factor)
    for sample, p in zip(samples, penalty.tolist(), strict=True):
        sample.reward = float(sample.reward or 0.0) + p
        sample.reward_info["overlong_penalty"] = p


def greedy_baseline(
    router: EngineRouter | list[Any],
    reward: Any,
    groups: list[list[Sample]],
    cfg: RelaxConfig,
    step: int,
    stop_token_ids: list[int],
) -> None:
    """ReMax baseline: one greedy response per group, scored by the reward role; its reward is
    stored on every member as ``reward_info["greedy_reward"]`` (call after scoring the group)."""
    probes = [
        [
            Sample(
                prompt_ids=list(g[0].prompt_ids),
                group_id=g[0].group_id,
                index_in_group=-1,
                prompt_text=g[0].prompt_text,
                label=g[0].label,
                metadata=dict(g[0].metadata),
                media=list(g[0].media),
                mm_inputs=g[0].mm_inputs,
            )
        ]
        for g in groups
        if g
    ]
    greedy = replace(sampling_params(cfg, stop_token_ids), temperature=0.0)
    generate(router, probes, cfg, step, stop_token_ids, params=greedy)
    scored, _ = score(reward, [p for (p,) in probes], cfg)
    by_group = {p.group_id: float(p.reward or 0.0) for p in scored}
    for g in groups:
        for s in g:
            s.reward_info["greedy_reward"] = by_group[s.group_id]


def fuse_old_logprobs(cfg: RelaxConfig, roles: Any, trainer_fuses: bool) -> bool:
    """verl's on-policy shortcut: no separate old-logprob forward; the trainer takes them from its
    first update's forward, detached (``trainer_fuses``: it declares ``fuses_old_logprobs()``).
    Only when nothing before the train step reads them: no reference or teacher role (their KL
    metrics and KL reward shaping compare against them) and an advantage estimator that declares
    neither ``old_logprobs`` nor ``sum_pi_squared`` (the policy's forward before the update, which
    also gives the old logprobs). Exact either way: both are the trainer's logprobs before the update."""
    if not (trainer_fuses and cfg.trainer.recompute_old_logprobs):
        return False
    if roles.reference is not None or getattr(roles, "teacher", None) is not None:
        return False
    from relax.core.algorithms.registry import algorithm_spec

    needs = algorithm_spec("advantage", cfg.algorithm.advantage_estimator).needs
    return not needs & {"old_logprobs", "sum_pi_squared"}


def engine_scored_old_logprobs(cfg: RelaxConfig, samples: list[Sample], version: int) -> bool:
    """Whether the engine's rollout logprobs of ``samples`` are the trainer's own old logprobs, so a
    trainer that fuses old logprobs (:func:`fuse_old_logprobs`) needs no forward for its later
    mini-batches either (column ``rollout_logprobs_exact``): the engine is hosted on the trainer's
    own module (``rollout.host`` driver/trainer: same weights, dtype and device), every token was
    sampled at the trainer's current ``version``, with no top-k / top-p truncation, so each logprob
    is ``log_softmax(logits / temperature)`` of the model the trainer scores with at that
    temperature; they differ by float noise (5e-7 mean absolute on the quick-start). Text only:
    with media the engine's and trainer's position and feature paths differ."""
    r = cfg.rollout
    return (
        r.top_k <= 0
        and r.top_p >= 1.0
        and hosts_engine(cfg)
        and all(s.mm_inputs is None and s.min_version == version == s.max_version for s in samples)
    )


def forward_batch(
    roles: Any,
    raw: dict[str, torch.Tensor],
    cfg: RelaxConfig,
    with_reference: bool = True,
    old_logprobs: bool = True,
) -> dict[str, torch.Tensor]:
    """The forward passes a collated batch needs, submitted together so the roles run concurrently:
    ``old_logprobs`` (policy; the engine's rollout logprobs when ``trainer.recompute_old_logprobs``
    is off; none when ``old_logprobs`` is False: the trainer fuses them, see
    :func:`fuse_old_logprobs`), ``ref_logprobs`` (reference role, unless ``with_reference`` is False
    because a queue role already computed them), ``teacher_logprobs`` (teacher role), ``values`` (critic),
    ``sum_pi_squared`` (policy, in the old-logprob forward, when a chosen algorithm declares it)."""
    refs = {}  # output -> (role, operation, ref)
    recompute = old_logprobs and cfg.trainer.recompute_old_logprobs
    spi = "sum_pi_squared" in config_needs(cfg.algorithm)
    if spi:  # one forward for both; its logprobs are dropped when the engine's are the old ones
        ref = roles.trainer.forward_logprobs_and_sum_pi_squared.remote(raw)
        refs["sum_pi_squared"] = ("trainer", "forward_logprobs_and_sum_pi_squared", ref)
    elif recompute:
        refs["old_logprobs"] = ("trainer", "forward_logprobs", roles.trainer.forward_logprobs.remote(raw))
    if cfg.algorithm.critic.enable:
        refs["values"] = ("trainer", "forward_values", roles.trainer.forward_values.remote(raw))
    if with_reference and roles.reference is not None:
        refs["ref_logprobs"] = ("reference", "forward_logprobs", roles.reference.forward_logprobs.remote(raw))
    if getattr(roles, "teacher", None) is not None:
        refs["teacher_logprobs"] = ("teacher", "forward_logprobs", roles.teacher.forward_logprobs.remote(raw))
    deadline = time.monotonic() + cfg.trainer.timeout_s  # the calls run concurrently: one bound for all
    out = {
        name: faults.wait(ref, max(0.0, deadline - time.monotonic()), role, op)
        for name, (role, op, ref) in refs.items()
    }
    if spi:
        logprobs, out["sum_pi_squared"] = out["sum_pi_squared"]
        if recompute:
            out["old_logprobs"] = logprobs
    if old_logprobs:
        out.setdefault("old_logprobs", raw["rollout_logprobs"])
    return out


def reward_components(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """(B,) tensors of the numeric ``reward_info`` entries every sample has (multi-reward
    estimators such as GDPO normalise each on its own)."""
    if not samples:
        return {}
    keys = set.intersection(*(set(s.reward_info) for s in samples))
    numeric = [k for k in sorted(keys) if all(isinstance(s.reward_info[k], int | float) for s in samples)]
    return {k: torch.tensor([float(s.reward_info[k]) for s in samples]) for k in numeric}


def prepare_batch(
    samples: list[Sample],
    pad_id: int,
    cfg: RelaxConfig,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    *,
    values: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    raw: dict[str, torch.Tensor] | None = None,
    advantages: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Collate (or reuse ``raw``, the collated ``samples``), attach old/ref/teacher logprobs, critic
    values and advantages -- computed here unless an advantage role already did (``advantages``,
    then also the returns); greedy baseline rewards come from ``reward_info["greedy_reward"]``;
    ``sum_pi_squared`` only feeds the estimator (it is not a training column).
    ``old_logprobs`` None: the trainer computes them (and reports the rollout/train mismatch)."""
    batch = dict(raw) if raw is not None else collate(samples, pad_id)
    mask = batch["response_mask"]
    for name, tensor in [
        ("old_logprobs", old_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("teacher_logprobs", teacher_logprobs),
        ("values", values),
    ]:
        if tensor is not None:
            batch[name] = tensor
    greedy = None
    if cfg.algorithm.greedy_baseline:
        greedy = torch.tensor([s.reward_info["greedy_reward"] for s in samples], dtype=torch.float32)
    if advantages is None:
        kl_coef = cfg.algorithm.kl.coef if cfg.algorithm.kl.use == "reward" else 0.0
        inputs = AdvantageInputs(
            rewards=batch["rewards"],
            response_mask=mask,
            index=batch["group_index"],
            values=values,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            kl_coef=kl_coef,
            greedy_rewards=greedy,
            sum_pi_squared=sum_pi_squared,
            reward_components=reward_components(samples),
        )
        advantages, returns = compute_advantages(cfg.algorithm, inputs)
    else:
        returns = advantages
    batch["advantages"] = advantages
    batch["returns"] = returns
    metrics: dict[str, float] = {}
    tokens = mask.sum().clamp(min=1)
    metrics["adv/mean"] = float((advantages * mask).sum() / tokens)
    metrics["adv/abs_mean"] = float((advantages.abs() * mask).sum() / tokens)
    if old_logprobs is not None and old_logprobs is not batch["rollout_logprobs"]:  # else nothing to compare
        mismatch = mismatch_metrics(old_logprobs, batch["rollout_logprobs"], mask)
        metrics["rollout/train_logprob_abs_diff"] = mismatch["mismatch_abs_logprob_diff"]
        metrics["rollout/train_k3_kl"] = mismatch["mismatch_k3_kl"]
    if ref_logprobs is not None:
        kl = get_kl_estimator(cfg.algorithm.kl.estimator)(old_logprobs, ref_logprobs)
        metrics["kl/policy_ref"] = float((kl * mask).sum() / tokens)
    if teacher_logprobs is not None:
        metrics["kl/policy_teacher"] = float(((old_logprobs - teacher_logprobs) * mask).sum() / tokens)
    if values is not None:
        metrics["critic/values_mean"] = float((values * mask).sum() / tokens)
        metrics["critic/returns_mean"] = float((returns * mask).sum() / tokens)
    if greedy is not None:
        metrics["reward/greedy_mean"] = float(greedy.mean())
    if sum_pi_squared is not None:  # 1 / effective vocabulary size: how peaked the policy is
        metrics["policy/sum_pi_squared_mean"] = float((sum_pi_squared * mask).sum() / tokens)
    return batch, metrics


def sample_metrics(samples: list[Sample]) -> dict[str, float]:
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    scores = [s.reward_info.get("score", s.reward or 0.0) for s in samples]
    correct = torch.tensor(
        [float(s.reward_info.get("acc", float(v >= 1.0))) for s, v in zip(samples, scores, strict=True)]
    )
    group_ids = [s.group_id for s in samples]
    metrics = {
        "data/group_id_min": float(min(group_ids)),  # which prompts a step drew: resume checks use it
        "data/group_id_max": float(max(group_ids)),
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/accuracy": float(correct.mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    from relax.core.rewards.runner import reward_metrics

    metrics.update(reward_metrics(samples))  # reward/<key>_mean of reward_info, failure and timeout counts
    metrics.update(episode_metrics(samples))
    penalties = [s.reward_info["overlong_penalty"] for s in samples if "overlong_penalty" in s.reward_info]
    if penalties:
        metrics["reward/overlong_penalty_mean"] = sum(penalties) / len(samples)
        metrics["reward/overlong_frac"] = sum(p < 0 for p in penalties) / len(samples)
    return metrics


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Multi-turn rollouts: ``episode/<counter>_mean`` per episode (turns, tool calls, tool errors,
    observation tokens, truncations, timeouts, errors, and what the environment counts)."""
    stats = [s.metadata["episode"] for s in samples if "episode" in s.metadata]
    keys = sorted({k for st in stats for k in st})
    return {f"episode/{k}_mean": sum(st.get(k, 0.0) for st in stats) / len(stats) for k in keys}
