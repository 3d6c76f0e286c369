"""Replacing a fleet's lost engines: the restart budget (``rollout.max_restarts``), the back-off
(``rollout.restart_backoff_s``, doubled after each replacement that failed to start), waiting for Ray's
verdict on a lost engine's node and for its reservation on an alive node, and saying why an engine
will not come back. Composed into :class:`relax.core.controller.fleet.EngineFleet` (it owns the
engines, their indices and reservations; this owns the replacement counts)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from relax.core.controller.faults import alive, describe
from relax.core.controller.shortfall import Lost

if TYPE_CHECKING:
    from relax.core.controller.fleet import EngineFleet

log = logging.getLogger("relax")

REMIND_S = 60.0  # how often the console repeats what a missing engine waits for


class Replacements:
    def __init__(self, fleet: EngineFleet) -> None:
        self.fleet = fleet
        self.started = 0  # replacement engines started so far
        self.in_progress = 0  # replacements in progress
        self.failed_starts = 0  # consecutive replacements that failed to start (backoff exponent)

    def trainer_gone(self) -> bool:
        """A replacement is synced from the trainer: with the trainer dead it could only fail (and the
        trainer's death, not the engine's, is what the run reports: ``recovery.blame_trainer``)."""
        fleet = self.fleet
        return fleet.trainer is not None and not alive(fleet.trainer, fleet.rollout.control_timeout_s)

    def schedule(self, lost: Lost, reason: str) -> bool:
        """Replace ``lost`` in a thread if restarts remain (True); else say why none comes (False)."""
        fleet = self.fleet
        cap = fleet.rollout.max_restarts
        if fleet._stop.is_set():
            return self.give_up(lost, reason, "the run is stopping")
        if cap and self.trainer_gone():
            return self.give_up(lost, reason, "the trainer is gone")
        with fleet._lock:
            if fleet._stop.is_set() or self.started >= cap:
                spent = (
                    "the run is stopping"
                    if fleet._stop.is_set()
                    else f"rollout.max_restarts={cap} "
                    + (f"spent ({self.started} replacements)" if cap else "allows none")
                )
                index = None
            else:
                self.started += 1
                self.in_progress += 1
                index, attempt = fleet._take_index(), self.started
                fleet._slots[index] = lost.slot  # the replacement runs where the lost engine ran
                if lost.index in fleet._params:  # ... and serves from the same server
                    fleet._params[index] = fleet._params[lost.index]
        if index is None:
            return self.give_up(lost, reason, spent)
        fleet.shortfall.replacing(index, lost)
        log.warning(
            "relax: %s; evicted it, starting rollout engine[%d] as replacement %d of at most %d",
            reason,
            index,
            attempt,
            cap,
        )
        threading.Thread(
            target=self._replace, args=(lost, index, reason), name=f"relax-replace-{index}", daemon=True
        ).start()
        return True

    def give_up(self, lost: Lost, reason: str, why: str) -> bool:
        """``lost`` will not be replaced: said, shown by ``shortfall``, and its reservation freed for an
        engine added later (``relax scale-out`` fills the gap). Returns False."""
        fleet = self.fleet
        fleet.shortfall.gave_up(lost, why)
        with fleet._lock:
            if lost.slot is not None and lost.slot not in fleet._free_slots:
                fleet._free_slots.append(lost.slot)
        log.error(
            "relax: %s; evicted it; rollout engine[%d] will not be replaced: %s", reason, lost.index, why
        )
        return False

    def _replace(self, lost: Lost, index: int, reason: str) -> None:
        fleet = self.fleet
        error: BaseException | None = None
        trainer_gone = died_with_node = False
        try:
            stopped = fleet._stop.wait(fleet.rollout.restart_backoff_s * 2**self.failed_starts)
            stopped = stopped or self._await_place(lost, index)
            trainer_gone = not stopped and self.trainer_gone()
            if not (stopped or trainer_gone):
                try:
                    fleet._start([index])
                except Exception as exc:
                    error = exc
                    died_with_node = self._died_with_node(exc)
        finally:
            fleet.shortfall.settled(index)
            with fleet._lock:
                self.in_progress -= 1
                if died_with_node:  # its node died under it: no fault of the engine, no restart spent
                    self.started -= 1
                self.failed_starts = 0 if error is None or died_with_node else self.failed_starts + 1
                if error is not None:
                    fleet._slots.pop(index, None)
        if stopped or fleet._stop.is_set():
            return
        if trainer_gone or (error is not None and self.trainer_gone()):
            why = f"{reason}; rollout engine[{index}] not started: the trainer is gone"
            log.error("relax: %s", why)
            fleet.shortfall.gave_up(lost, "the trainer is gone")
            fleet.close_if_empty(why)
            return
        if error is not None:
            if not died_with_node:
                fleet.counters.add("engine_start_failures")
            what = "died with its node" if died_with_node else f"failed to start ({describe(error)})"
            why = f"{reason}; its replacement rollout engine[{index}] {what}"
            log.error("relax: %s", why)
            node = getattr(error, "relax_node", None) if died_with_node else lost.node
            if not self.schedule(replace(lost, node=node), why):
                fleet.close_if_empty(why)
            return
        seconds = time.monotonic() - lost.at  # from the loss, not from the last attempt
        fleet.counters.add("engine_restarts")
        fleet.counters.set("last_recovery_s", seconds)
        log.warning(
            "relax: rollout engine[%d] serves in place of engine[%d], %.1fs after it was lost",
            index,
            lost.index,
            seconds,
        )

    def _await_place(self, lost: Lost, index: int) -> bool:
        """Before replacing ``lost``: Ray's verdict on its node, then its reservation on an alive node
        (other than a dead one's), however long that takes (a node must join). True: the run stopped."""
        fleet = self.fleet
        places = fleet._places
        if places is None:
            return False
        exclude = None
        if lost.node is not None:
            fleet.shortfall.waiting(index, f"Ray's verdict on the node engine[{lost.index}] ran on")
            verdict = places.verdict(lost.node, fleet._stop)
            if verdict == "stopped":
                return True
            exclude = lost.node if verdict == "dead" else None
            if exclude:
                log.warning(
                    "relax: Ray declared the node of rollout engine[%d] dead; its replacement engine[%d] "
                    "goes to another node",
                    lost.index,
                    index,
                )
        with fleet._lock:
            slot = fleet._slots.get(index)

        said = [0.0]

        def waiting() -> None:  # said when the wait starts, and again every REMIND_S while it lasts
            if fleet.shortfall.waiting(index, places.wants()) or time.monotonic() - said[0] > REMIND_S:
                said[0] = time.monotonic()
                log.warning(
                    "relax: rollout engine[%d] (replacing engine[%d]) waits for %s (its reservation is on "
                    "no alive node); start one: %s",
                    index,
                    lost.index,
                    places.wants(),
                    places.fix(),
                )

        return not places.await_slot(slot, exclude, fleet._stop, waiting)

    def _died_with_node(self, error: BaseException) -> bool:
        fleet = self.fleet
        node = getattr(error, "relax_node", None)
        return bool(fleet._places and node and fleet._places.verdict(node, fleet._stop) == "dead")
