"""A bounded call of a scorer: the public building blocks of core's reward runner.

A reward that calls other rewards (a router, a hub, an ensemble) scores them the way core does:

    from relax.core.rewards.bounded import ScorerTimeout, as_result, bounded, call_scorer

    try:
        value = await bounded(call_scorer(reward.score, sample), timeout_s=10)
        score, info = as_result(value)
    except ScorerTimeout:
        ...  # the call is abandoned, never awaited

``call_scorer`` runs a plain ``def`` in a daemon thread of its own and awaits an ``async def``;
``bounded`` abandons a call that outlives its timeout, so a hung scorer never holds up the caller,
the event loop or its shutdown (a thread that never returns is simply left behind). ``as_result``
checks and normalises what a scorer returned.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any


class ScorerTimeout(TimeoutError):
    """A call passed to :func:`bounded` did not finish within its timeout (and was abandoned)."""


def as_result(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, reward_info)`` from what a scorer returned: a finite float, or a dict with a finite
    ``"score"`` whose other values are numbers (kept as floats). ``TypeError`` / ``ValueError`` else."""
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


class _DaemonWorkers:
    """Daemon threads reused across calls: an idle worker takes the next call, else a new one starts.
    A worker whose call never returns is never idle again, so it is simply left behind as before,
    while a run scoring thousands of cheap plain-``def`` calls no longer starts a thread for each.
    Idle workers exit after ``idle_s``."""

    def __init__(self, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # each idle worker's inbox, most recent last

    def run(self, job: Callable[[], None], name: str) -> None:
        """``job()`` in a worker thread named ``name`` while it runs (a hung call is named by its thread)."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put((job, name))
        else:
            threading.Thread(target=self._work, args=((job, name),), name=name, daemon=True).start()

    def _work(self, task: tuple[Callable[[], None], str]) -> None:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while True:
            job, threading.current_thread().name = task
            job()
            threading.current_thread().name = "relax-reward-idle"
            with self._lock:
                self._idle.append(inbox)
            try:
                task = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody picked this worker: exit
                        self._idle.remove(inbox)
                        return
                task = inbox.get()  # picked just now: its job is on the way


_WORKERS = _DaemonWorkers()


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run ``fn(*args)`` in a daemon thread (a reused idle one, or a new one); the future resolves on
    this loop. Nothing joins the thread, so a call that never returns is simply left behind when its
    future is abandoned."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def job() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001  # handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    _WORKERS.run(job, f"relax-reward-{getattr(fn, '__name__', 'call')}")
    return future


async def call_scorer(fn: Callable[..., Any], arg: Any) -> Any:
    """``fn(arg)`` for a sync or async scorer (``reward.score``, ``reward.score_group``): awaited if a
    coroutine function, else run in a daemon thread (and its result awaited if it is awaitable, e.g.
    a plain method that returns a coroutine)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(arg)
    value = await in_daemon_thread(fn, arg)
    return await value if inspect.isawaitable(value) else value


async def bounded(call: Awaitable[Any], timeout_s: float) -> Any:
    """Await ``call`` for at most ``timeout_s`` seconds; past it (or when the caller is cancelled)
    cancel it without waiting for it and raise :class:`ScorerTimeout`. A call that ignores its
    cancellation cannot hold the caller."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            task.cancel()  # never awaited: a call that ignores cancellation cannot hold us
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # silence "never retrieved"
    if not done:
        raise ScorerTimeout(f"did not finish within {timeout_s:g}s")
    return task.result()


async def score_bounded(fn: Callable[..., Any], arg: Any, timeout_s: float) -> tuple[float, dict[str, float]]:
    """``as_result(fn(arg))`` within ``timeout_s``: the whole bounded call of one sync or async scorer."""
    return as_result(await bounded(call_scorer(fn, arg), timeout_s))


__all__ = ["ScorerTimeout", "as_result", "bounded", "call_scorer", "in_daemon_thread", "score_bounded"]
