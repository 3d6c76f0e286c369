"""Run blocking calls at once, each in its own daemon thread, none waited on past a deadline."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

TIMEOUT = object()  # the outcome of a call still running at the deadline


class EpisodeTimeout(BaseException):
    """Raised inside a call's thread once the call overran its deadline, to stop it. A ``BaseException``,
    so that a plugin's ``except Exception`` does not swallow it and carry on."""


def interrupt(thread: threading.Thread) -> bool:
    """Raise :class:`EpisodeTimeout` in ``thread`` at its next Python bytecode (a call blocked in C -- a
    sleep, a socket read -- stops when that returns). False when the thread was gone already."""
    if thread.ident is None or not thread.is_alive():
        return False
    return (
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(EpisodeTimeout)
        )
        == 1
    )


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[tuple[Any, BaseException | None]]:
    """``(value, None)``, ``(None, exception)`` or ``(TIMEOUT, None)`` per call, in order.

    A call that overruns is interrupted (:func:`interrupt`): a Python thread cannot be killed, but a busy
    loop stops at once and a blocking call when it returns, instead of running for the rest of the run.
    Its late outcome is dropped. Daemon threads, so an abandoned one never keeps the process alive."""
    lock = threading.Lock()
    outcomes: list[tuple[Any, BaseException | None]] = [(TIMEOUT, None)] * len(calls)
    finished = [False] * len(calls)
    open_ = [True]

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            try:
                outcome = (call(), None)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller, named there
                outcome = (None, exc)
            with lock:
                finished[i] = True
                if open_[0]:
                    outcomes[i] = outcome
        except EpisodeTimeout:  # arrived after the call returned: nothing left to stop
            pass

    threads = [
        threading.Thread(target=run, args=(i, c), daemon=True, name=f"episode-call-{i}")
        for i, c in enumerate(calls)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        open_[0] = False
        for i, t in enumerate(threads):
            if not finished[i]:
                interrupt(t)
        return list(outcomes)
