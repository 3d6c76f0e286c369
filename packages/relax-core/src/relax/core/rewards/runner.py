"""Score samples concurrently with a per-sample timeout; a failing reward is an error, never a hang.

A timed-out score is cancelled and abandoned rather than awaited, so even a reward that swallows
cancellation cannot block the step. Async rewards must not block the event loop (CPU-heavy work
belongs in ``asyncio.to_thread``); a reward whose ``score`` is a plain function is run in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward raised, timed out or returned something invalid for one sample."""


@dataclass(frozen=True)
class ScoreStats:
    scored: int  # samples whose reward came from the reward function
    errors: int  # raised or returned an invalid value (scored 0.0 under on_error="zero")
    timeouts: int  # exceeded timeout_s (scored 0.0 under on_error="zero")
    seconds: float
    first_error: str | None = None

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts


class _Timeout(Exception):
    pass


def _as_result(value: Any) -> tuple[float, dict[str, float]]:
    """(score, reward_info) from a float or a dict with "score"; raises TypeError/ValueError."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score': {sorted(value)}")
        info = {k: float(v) for k, v in value.items()}
    elif isinstance(value, numbers.Real):
        info = {"score": float(value)}
    else:
        raise TypeError(f"returned {type(value).__name__}; expected a float or a dict with 'score'")
    if not math.isfinite(info["score"]):
        raise ValueError(f"returned a non-finite score {info['score']}")
    return info["score"], info


async def _score_one(reward: Any, sample: Any, timeout_s: float) -> Any:
    if inspect.iscoroutinefunction(reward.score):
        task = asyncio.ensure_future(reward.score(sample))
    else:
        task = asyncio.ensure_future(asyncio.to_thread(reward.score, sample))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:  # on timeout or when we are cancelled: cancel, but never wait for it to stop
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # silence "never retrieved"
    if not done:
        raise _Timeout
    return task.result()


async def score_samples(
    reward: Any,
    samples: Sequence[Any],
    timeout_s: float = 60.0,
    max_concurrency: int = 64,
    on_error: Literal["raise", "zero"] = "raise",
    reward_name: str | None = None,
) -> ScoreStats:
    """Set ``sample.reward`` and ``sample.reward_info`` on every sample.

    ``on_error="raise"``: the first failure raises ``RewardError`` naming the reward, the sample
    (group and index) and the cause. ``on_error="zero"``: a failed sample scores 0.0 with
    ``reward_info={"score": 0.0, "reward_failed": 1.0}`` and is counted in the returned stats.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"reward.on_error must be 'raise' or 'zero', got {on_error!r}")
    if timeout_s <= 0 or max_concurrency < 1:
        raise ValueError(f"need timeout_s > 0 and max_concurrency >= 1, got {timeout_s}, {max_concurrency}")
    name = reward_name or type(reward).__name__
    sem = asyncio.Semaphore(max_concurrency)
    counts = {"scored": 0, "errors": 0, "timeouts": 0}
    first_error: list[str] = []
    start = time.perf_counter()

    async def run(sample: Any) -> None:
        where = f"reward {name!r} on sample group {sample.group_id} index {sample.index_in_group}"
        async with sem:
            try:
                score, info = _as_result(await _score_one(reward, sample, timeout_s))
            except _Timeout:
                kind, msg = "timeouts", f"{where}: timed out after {timeout_s:g}s"
                cause = None
            except Exception as e:  # noqa: BLE001  # any reward bug becomes a RewardError
                kind, msg = "errors", f"{where}: {type(e).__name__}: {e}"
                cause = e
            else:
                sample.reward, sample.reward_info = score, info
                counts["scored"] += 1
                return
        if on_error == "raise":
            raise RewardError(msg) from cause
        if not first_error:
            first_error.append(msg)
            log.warning("%s (scored 0.0; further failures are only counted)", msg)
        counts[kind] += 1
        sample.reward, sample.reward_info = 0.0, {"score": 0.0, "reward_failed": 1.0}

    tasks = [asyncio.ensure_future(run(s)) for s in samples]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # after a RewardError, stop scoring the rest
    return ScoreStats(
        **counts, seconds=time.perf_counter() - start, first_error=first_error[0] if first_error else None
    )
