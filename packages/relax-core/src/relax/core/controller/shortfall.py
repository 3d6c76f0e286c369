"""How many rollout engines the run wants, which are missing, what each missing one waits for and
since when, and which will not come back and why -- what the console, ``relax status``, the metrics
and the stop message say while engines are missing. Pure bookkeeping (thread-safe, no Ray): the fleet
tells it what happens.

``wanted`` is the configured count plus the engines added at run time, less those removed on purpose
(scale-in). A lost engine stays wanted: while it is being replaced it is *pending* (with what it
waits for); once no replacement will come it is *not replaced* (with why) until an engine added at
run time takes its reservation (``relax scale-out`` filling the gap).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Lost:
    """One engine lost; the monotonic ``at`` is when (recovery time is measured from it)."""

    index: int
    reason: str
    slot: int | None = None  # the configured engine's reservation it ran on
    node: str | None = None  # the Ray node id it ran on
    at: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)


@dataclass
class Pending:
    lost: Lost
    waiting_for: str = "its restart back-off"
    since: float = field(default_factory=time.time)


class Shortfall:
    def __init__(self, wanted: int) -> None:
        self._lock = threading.Lock()
        self.wanted = wanted
        self.pending: dict[int, Pending] = {}  # replacement index -> what it waits for
        self.not_replaced: dict[int, tuple[Lost, str]] = {}  # lost index -> (the loss, why no replacement)

    def added(self, n: int, filled: list[int] | None = None) -> None:
        """``n`` engines were added; ``filled``: lost engines whose reservations some of them took."""
        with self._lock:
            for index in filled or []:
                self.not_replaced.pop(index, None)
            self.wanted += n - len(filled or [])

    def removed(self) -> None:
        with self._lock:
            self.wanted -= 1

    def replacing(self, index: int, lost: Lost) -> None:
        with self._lock:
            self.pending[index] = Pending(lost)

    def waiting(self, index: int, what: str) -> bool:
        """Replacement ``index`` now waits for ``what``; True when that is new (say it once)."""
        with self._lock:
            entry = self.pending.get(index)
            if entry is None or entry.waiting_for == what:
                return False
            entry.waiting_for, entry.since = what, time.time()
            return True

    def settled(self, index: int) -> None:
        """Replacement ``index`` serves, or was abandoned (then the loss is ``gave_up``'s)."""
        with self._lock:
            self.pending.pop(index, None)

    def gave_up(self, lost: Lost, why: str) -> None:
        with self._lock:
            self.not_replaced[lost.index] = (lost, why)

    def orphan_of(self, slot: int) -> int | None:
        """The lost, not replaced engine whose reservation ``slot`` was (an added engine takes it over)."""
        with self._lock:
            return next((i for i, (lost, _) in self.not_replaced.items() if lost.slot == slot), None)

    def status(self, live: int) -> dict:
        """``{"engines_live", "engines_wanted", "waiting": [...], "not_replaced": [...]}``."""
        with self._lock:
            waiting = [
                {
                    "engine_id": i,
                    "replaces": p.lost.index,
                    "waiting_for": p.waiting_for,
                    "since": p.since,
                    "lost": p.lost.reason,
                }
                for i, p in sorted(self.pending.items())
            ]
            gone = [
                {"engine_id": i, "why": why, "lost": lost.reason}
                for i, (lost, why) in sorted(self.not_replaced.items())
            ]
            return {
                "engines_live": live,
                "engines_wanted": self.wanted,
                "waiting": waiting,
                "not_replaced": gone,
            }

    def line(self, live: int) -> str | None:
        """One line for the console and the stop message while engines are missing; None when none is."""
        s = self.status(live)
        if live >= s["engines_wanted"] and not s["waiting"]:
            return None
        parts = [f"{live} of {s['engines_wanted']} rollout engines live"]
        parts += [
            f"engine[{w['engine_id']}] (replacing engine[{w['replaces']}]) waits for {w['waiting_for']} since "
            f"{time.strftime('%H:%M:%S', time.localtime(w['since']))}"
            for w in s["waiting"]
        ]
        parts += [f"engine[{g['engine_id']}] will not be replaced: {g['why']}" for g in s["not_replaced"]]
        return "; ".join(parts)
