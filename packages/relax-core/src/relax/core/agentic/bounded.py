"""Run blocking calls at once, each in its own daemon thread, none waited on past a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

TIMEOUT = object()  # the outcome of a call still running at the deadline


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[tuple[Any, BaseException | None]]:
    """``(value, None)``, ``(None, exception)`` or ``(TIMEOUT, None)`` per call, in order.

    A call that overruns is abandoned (a Python thread cannot be killed); its late outcome is
    dropped. Daemon threads, so an abandoned one never keeps the process alive."""
    lock = threading.Lock()
    outcomes: list[tuple[Any, BaseException | None]] = [(TIMEOUT, None)] * len(calls)
    open_ = [True]

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            outcome = (call(), None)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, named there
            outcome = (None, exc)
        with lock:
            if open_[0]:
                outcomes[i] = outcome

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"episode-call-{i}") for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        open_[0] = False
        return list(outcomes)
