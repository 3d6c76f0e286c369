"""Score samples concurrently with a per-call timeout; a failing reward is an error, never a hang.

A timed-out call is abandoned, never awaited: an ``async def score`` is cancelled and left behind
(even one that swallows the cancellation), a plain ``def score`` runs in daemon threads that nothing
ever joins (``relax.core.rewards.lanes``: a few threads taking one sample after another, each call
limited from its own start) -- so neither the step nor the event loop's shutdown waits for it (the
default executor of ``asyncio.to_thread`` would be joined by ``asyncio.run``). ``ScoringLoop``
goes one further for the reward role: scoring runs on a loop that is never closed, so abandoned
coroutines cost nothing at all.

A reward with ``score_group(samples)`` is called once per group (the samples sharing a
``group_id``), with the same timeout and error handling per call; it returns one result per sample.
Results are a float or a dict with ``"score"``; the dict's other numeric keys are kept in
``sample.reward_info`` (logged as ``reward/<key>_mean``). Failed samples carry
``reward_failed`` (and ``reward_timeout``) = 1.0 in ``reward_info``, so their counts travel with the
samples in every mode. The bounded call itself is public (``relax.core.rewards.bounded``), for
rewards that call other rewards.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from relax.core.config import RewardConfig
from relax.core.failures import add_failure
from relax.core.rewards.bounded import ScorerTimeout, as_result, bounded, call_scorer
from relax.core.rewards.lanes import score_in_lanes

log = logging.getLogger(__name__)

_DEFAULTS = RewardConfig()  # one place for the defaults: the run config's ``reward:`` section
FAILED, TIMED_OUT = "reward_failed", "reward_timeout"  # reward_info flags of a sample that got the fallback


class RewardError(RuntimeError):
    """A reward raised, timed out or returned something invalid for one sample."""


@dataclass(frozen=True)
class ScoreStats:
    scored: int  # samples whose reward came from the reward function
    errors: int  # raised or returned an invalid value (scored fallback_score under on_error="zero")
    timeouts: int  # exceeded timeout_s (scored fallback_score under on_error="zero")
    seconds: float
    first_error: str | None = None

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts


def _units(reward: Any, samples: Sequence[Any]) -> list[list[Any]]:
    """One call's samples each: whole groups for ``score_group``, else single samples."""
    if not callable(getattr(reward, "score_group", None)):
        return [[s] for s in samples]
    groups: dict[Any, list[Any]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())


async def score_samples(
    reward: Any,
    samples: Sequence[Any],
    timeout_s: float = _DEFAULTS.timeout_s,
    max_concurrency: int = _DEFAULTS.max_concurrency,
    on_error: Literal["raise", "zero"] = _DEFAULTS.on_error,
    reward_name: str | None = None,
    fallback_score: float = _DEFAULTS.fallback_score,
) -> ScoreStats:
    """Set ``sample.reward`` and ``sample.reward_info`` on every sample.

    ``on_error="raise"``: the first failure raises ``RewardError`` naming the reward, the sample
    (group and index) and the cause. ``on_error="zero"``: a failed sample scores ``fallback_score``
    with ``reward_info={"score": fallback_score, "reward_failed": 1.0}`` (plus ``"reward_timeout":
    1.0`` for a timeout) and is counted in the returned stats. Counts are per sample, also when a
    ``score_group`` call fails for its whole group.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"reward.on_error must be 'raise' or 'zero', got {on_error!r}")
    if not (timeout_s > 0 and max_concurrency >= 1 and math.isfinite(fallback_score)):
        raise ValueError(
            f"need timeout_s > 0, max_concurrency >= 1 and a finite fallback_score, got "
            f"{timeout_s}, {max_concurrency}, {fallback_score}"
        )
    name = reward_name or type(reward).__name__
    sem = asyncio.Semaphore(max_concurrency)
    counts = {"scored": 0, "errors": 0, "timeouts": 0}
    first_error: list[str] = []
    start = time.perf_counter()
    by_group = callable(getattr(reward, "score_group", None))

    async def call(unit: list[Any]) -> list[tuple[float, dict[str, float]]]:
        if not by_group:
            return [as_result(await bounded(call_scorer(reward.score, unit[0]), timeout_s))]
        values = await bounded(call_scorer(reward.score_group, unit), timeout_s)
        if not isinstance(values, list | tuple) or len(values) != len(unit):
            got = f"{len(values)} results" if isinstance(values, list | tuple) else type(values).__name__
            raise ValueError(f"score_group returned {got} for {len(unit)} samples")
        return [as_result(v) for v in values]

    def where(unit: list[Any]) -> str:
        head = unit[0]
        return f"reward {name!r} on sample group {head.group_id}" + (
            "" if by_group else f" index {head.index_in_group}"
        )

    def scored(unit: list[Any], results: list[tuple[float, dict[str, float]]]) -> None:
        for sample, (score, info) in zip(unit, results, strict=True):
            sample.reward, sample.reward_info = score, info
        counts["scored"] += len(unit)

    def failed(unit: list[Any], error: BaseException) -> None:
        """Raise (``on_error="raise"``) or score the fallback and count it."""
        if isinstance(error, ScorerTimeout):
            kind, msg, cause = "timeouts", f"{where(unit)}: timed out after {timeout_s:g}s", None
        else:
            kind, msg, cause = "errors", f"{where(unit)}: {type(error).__name__}: {error}", error
        if on_error == "raise":
            raise RewardError(msg) from cause
        if not first_error:
            first_error.append(msg)
            log.warning("%s (scored %g; further failures are only counted)", msg, fallback_score)
        counts[kind] += len(unit)
        flags = {FAILED: 1.0, **({TIMED_OUT: 1.0} if kind == "timeouts" else {})}
        reason = f"reward {name!r} " + (
            f"timed out after {timeout_s:g}s" if cause is None else f"raised {type(error).__name__}: {error}"
        )
        for sample in unit:
            sample.reward, sample.reward_info = fallback_score, {"score": fallback_score, **flags}
            add_failure(
                sample, "reward", f"{reason} (scored {fallback_score:g})", cause
            )  # the driver reports it

    async def run(unit: list[Any]) -> None:
        async with sem:
            try:
                results = await call(unit)
            except Exception as e:  # noqa: BLE001  # any reward bug becomes a RewardError
                failed(unit, e)
            else:
                scored(unit, results)

    units = _units(reward, samples)
    if not by_group and not inspect.iscoroutinefunction(
        reward.score
    ):  # a plain def: lanes, not a hand-off each
        outcomes = await score_in_lanes(
            reward.score,
            [u[0] for u in units],
            timeout_s,
            max_concurrency,
            stop_on_failure=on_error == "raise",
        )
        for unit, outcome in zip(units, outcomes, strict=True):
            if outcome is None:  # not started: an earlier failure raises below
                continue
            kind, value = outcome
            try:
                if kind == "timeout":
                    raise ScorerTimeout(f"did not finish within {timeout_s:g}s")
                if kind == "error":
                    raise value
                if inspect.isawaitable(value):  # a plain method that returned a coroutine
                    value = await bounded(value, timeout_s)
                result = as_result(value)
            except Exception as e:  # noqa: BLE001
                failed(unit, e)
            else:
                scored(unit, [result])
        return ScoreStats(
            **counts, seconds=time.perf_counter() - start, first_error=first_error[0] if first_error else None
        )
    tasks = [asyncio.ensure_future(run(u)) for u in units]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # after a RewardError, stop scoring the rest
    return ScoreStats(
        **counts, seconds=time.perf_counter() - start, first_error=first_error[0] if first_error else None
    )


class ScoringLoop:
    """An event loop in a daemon thread, never closed: abandoned reward calls stay on it instead of
    being awaited at shutdown. A reward that blocks the loop itself (a blocking call inside
    ``async def score``) is detected by ``run``'s overall bound; the loop is then replaced."""

    def __init__(self, margin_s: float = 30.0) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.margin_s = margin_s  # slack on top of the per-call timeouts before the loop counts as stuck

    def _ensure(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="relax-reward-loop", daemon=True).start()
        return self._loop

    def score(self, reward: Any, samples: Sequence[Any], **kwargs: Any) -> ScoreStats:
        """``score_samples`` on this loop; blocks the caller until every sample has a result."""
        timeout_s = kwargs.get("timeout_s", _DEFAULTS.timeout_s)
        waves = math.ceil(
            len(_units(reward, samples)) / kwargs.get("max_concurrency", _DEFAULTS.max_concurrency)
        )
        bound = (
            timeout_s * max(1, waves) + self.margin_s
        )  # every wave ends within timeout_s unless the loop is stuck
        future = asyncio.run_coroutine_threadsafe(score_samples(reward, samples, **kwargs), self._ensure())
        try:
            return future.result(timeout=bound)
        except TimeoutError:
            future.cancel()
            self._loop = None  # the stuck loop keeps its thread; later calls get a fresh loop
            name = kwargs.get("reward_name") or type(reward).__name__
            raise RewardError(
                f"reward {name!r}: scoring {len(samples)} samples did not finish within {bound:g}s although each "
                f"call is limited to {timeout_s:g}s: an async score() blocks its event loop (use a plain def, "
                "which runs in a thread, or asyncio.to_thread for blocking work)"
            ) from None


def reward_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """Step metrics from the samples' ``reward_info``: ``reward/<key>_mean`` for every numeric key
    (over the samples that carry it) and the ``reward/failures`` / ``reward/timeouts`` counts --
    computed from the samples themselves, so async and hybrid modes report them like colocate."""
    sums: dict[str, float] = {}
    seen: dict[str, int] = {}
    for s in samples:
        for key, value in s.reward_info.items():
            if key in (FAILED, TIMED_OUT) or not isinstance(value, numbers.Real):
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            seen[key] = seen.get(key, 0) + 1
    out = {f"reward/{key}_mean": sums[key] / seen[key] for key in sums}
    out["reward/failures"] = float(sum(s.reward_info.get(FAILED, 0.0) for s in samples))
    out["reward/timeouts"] = float(sum(s.reward_info.get(TIMED_OUT, 0.0) for s in samples))
    return out
