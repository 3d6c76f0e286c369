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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.core.config import RewardConfig
from relax.core.failures import add_failure
from relax.core.rewards.bounded import ScorerTimeout, as_result, bounded, call_scorer
from relax.core.rewards.lanes import Outcome, score_in_lanes

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


async def score_in_tasks(
    call: Callable[[Any], Awaitable[Any]], args: Sequence[Any], concurrency: int, stop_on_failure: bool
) -> list[Outcome | None]:
    """``await call(arg)`` for every arg as asyncio tasks, at most ``concurrency`` at once: the executor
    for ``async def`` scorers and ``score_group``, giving the outcomes of :func:`score_in_lanes`. With
    ``stop_on_failure`` the first failure cancels the rest (their outcome is ``None``)."""
    sem = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome | None] = [None] * len(args)

    async def one(i: int) -> bool:
        async with sem:
            try:
                outcomes[i] = ("ok", await call(args[i]))
            except Exception as e:  # noqa: BLE001  # any reward bug is this call's outcome
                outcomes[i] = ("error", e)
            return outcomes[i][0] == "ok"

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(args))]
    try:
        for finished in asyncio.as_completed(tasks):
            if not await finished and stop_on_failure:
                break
    finally:
        for t in tasks:
            t.cancel()  # after a failure under on_error="raise", stop scoring the rest
    return outcomes


async def _results(value: Any, size: int, by_group: bool, timeout_s: float) -> list[tuple[float, dict]]:
    """One call's return value as ``(score, reward_info)`` per sample; raises if it is invalid."""
    if inspect.isawaitable(value):  # a plain method that returned a coroutine
        value = await bounded(value, timeout_s)
    if not by_group:
        return [as_result(value)]
    if not isinstance(value, list | tuple) or len(value) != size:
        got = f"{len(value)} results" if isinstance(value, list | tuple) else type(value).__name__
        raise ValueError(f"score_group returned {got} for {size} samples")
    return [as_result(v) for v in value]


async def _outcomes(
    reward: Any, units: list[list[Any]], by_group: bool, timeout_s: float, concurrency: int, stop: bool
) -> list[Outcome | None]:
    """Each unit's outcome, its ``"ok"`` value checked into ``(score, reward_info)`` per sample: plain
    ``def score`` calls in lanes (checked after), the rest as tasks (checked in the task, so an invalid
    return stops the others at once under ``on_error="raise"``)."""
    if by_group or inspect.iscoroutinefunction(reward.score):
        fn = reward.score_group if by_group else reward.score

        async def call(unit: list[Any]) -> list[tuple[float, dict]]:
            value = await bounded(call_scorer(fn, unit if by_group else unit[0]), timeout_s)
            return await _results(value, len(unit), by_group, timeout_s)

        return await score_in_tasks(call, units, concurrency, stop)
    outcomes = await score_in_lanes(reward.score, [u[0] for u in units], timeout_s, concurrency, stop)
    for i, outcome in enumerate(outcomes):
        if outcome is not None and outcome[0] == "ok":
            try:
                outcomes[i] = ("ok", await _results(outcome[1], 1, False, timeout_s))
            except Exception as e:  # noqa: BLE001  # an invalid return value fails the sample
                outcomes[i] = ("error", e)
    return outcomes


@dataclass
class _Fold:
    """The one path from a call's outcome to its samples' rewards: the scores, or (raise, hang,
    invalid return alike) a ``RewardError`` or the fallback score with a counted, reported failure."""

    name: str
    by_group: bool
    timeout_s: float
    on_error: str
    fallback_score: float
    counts: dict[str, int] = field(default_factory=lambda: {"scored": 0, "errors": 0, "timeouts": 0})
    first_error: str | None = None

    def settle(self, unit: list[Any], outcome: Outcome) -> None:
        kind, value = outcome
        if kind == "timeout":
            return self.fail(unit, ScorerTimeout(f"did not finish within {self.timeout_s:g}s"))
        if kind == "error":
            return self.fail(unit, value)
        for sample, (score, info) in zip(unit, value, strict=True):
            sample.reward, sample.reward_info = score, info
        self.counts["scored"] += len(unit)

    def fail(self, unit: list[Any], error: BaseException) -> None:
        if not isinstance(error, Exception):
            raise error  # KeyboardInterrupt, SystemExit: not a reward failure
        timed_out = isinstance(error, ScorerTimeout)
        where = f"reward {self.name!r} on sample group {unit[0].group_id}" + (
            "" if self.by_group else f" index {unit[0].index_in_group}"
        )
        what = f"timed out after {self.timeout_s:g}s" if timed_out else f"{type(error).__name__}: {error}"
        cause = None if timed_out else error
        if self.on_error == "raise":
            raise RewardError(f"{where}: {what}") from cause
        if self.first_error is None:
            self.first_error = f"{where}: {what}"
            log.warning(
                "%s (scored %g; further failures are only counted)", self.first_error, self.fallback_score
            )
        self.counts["timeouts" if timed_out else "errors"] += len(unit)
        flags = {FAILED: 1.0, **({TIMED_OUT: 1.0} if timed_out else {})}
        reason = (
            f"reward {self.name!r} {what if timed_out else 'raised ' + what} (scored {self.fallback_score:g})"
        )
        for sample in unit:
            sample.reward, sample.reward_info = self.fallback_score, {"score": self.fallback_score, **flags}
            add_failure(sample, "reward", reason, cause)  # the driver reports it


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

    Two executors run the calls (lanes for a plain ``def score``, tasks otherwise); both give one
    ``Outcome`` per call, and one fold turns each into scores or a failure.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"reward.on_error must be 'raise' or 'zero', got {on_error!r}")
    if not (timeout_s > 0 and max_concurrency >= 1 and math.isfinite(fallback_score)):
        raise ValueError(
            f"need timeout_s > 0, max_concurrency >= 1 and a finite fallback_score, got "
            f"{timeout_s}, {max_concurrency}, {fallback_score}"
        )
    start = time.perf_counter()
    by_group = callable(getattr(reward, "score_group", None))
    units = _units(reward, samples)
    outcomes = await _outcomes(reward, units, by_group, timeout_s, max_concurrency, on_error == "raise")
    fold = _Fold(reward_name or type(reward).__name__, by_group, timeout_s, on_error, fallback_score)
    for unit, outcome in zip(units, outcomes, strict=True):
        if outcome is not None:  # None: not started, as an earlier failure raises
            fold.settle(unit, outcome)
    return ScoreStats(**fold.counts, seconds=time.perf_counter() - start, first_error=fold.first_error)


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
