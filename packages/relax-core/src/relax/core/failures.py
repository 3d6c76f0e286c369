"""Failures a user must see, one mechanism for episodes, tools, rewards and engines.

Where a failure happens (an episode that raised, a tool that hung, a reward that timed out) it is
recorded on the sample (:func:`add_failure`: ``sample.metadata["failures"]``), so it travels with
the sample from whichever process scored or stepped it. The driver's :class:`FailureLog` takes each
step's samples: the first ``logging.failure_warnings`` failures of each kind are logged at WARNING
with their reason and sample id (then one line with the count of the rest), every one is appended to
``<run_dir>/failures.jsonl`` (kind, step, id, reason, traceback tail), the end summary lists counts
and top reasons, and a run in which more than ``logging.fail_if_failure_rate_above`` of the samples
failed (over ``logging.failure_window_steps`` steps, and over the whole run at its end) is stopped
with :class:`FailureRateError` naming the top reason -- never an exit 0 that looks like success.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections import Counter, deque
from pathlib import Path
from typing import Any

log = logging.getLogger("relax")

#: kinds whose failure loses the sample's score (a tool failure is observed by the policy instead)
SAMPLE_KINDS = ("episode", "reward")


class FailureRateError(RuntimeError):
    """Most samples failed: the run stops instead of training on fallback scores."""


def traceback_tail(exc: BaseException, lines: int = 6) -> str:
    """The last ``lines`` lines of ``exc``'s traceback (where it was raised, and what)."""
    return "\n".join("".join(traceback.format_exception(exc)).rstrip().splitlines()[-lines:])


def add_failure(sample: Any, kind: str, reason: str, exc: BaseException | None = None) -> None:
    """Record a failure on ``sample`` (kind: ``episode``, ``tool``, ``reward``, ``engine``); a sample-like
    object without a ``metadata`` dict (a reward's own test double) is left alone."""
    if not isinstance(getattr(sample, "metadata", None), dict):
        return
    entry = {"kind": kind, "reason": reason}
    if exc is not None:
        entry["traceback"] = traceback_tail(exc)
    sample.metadata.setdefault("failures", []).append(entry)


def sample_id(sample: Any) -> str:
    return f"group {sample.group_id} index {sample.index_in_group}"


def _headline(reason: str, width: int = 160) -> str:
    """The reason's first line, cut: what counts as 'the same reason' in the summary."""
    first = (reason.strip().splitlines() or [""])[0]
    return first if len(first) <= width else first[: width - 3] + "..."


class FailureLog:
    """Per run, in the driver: logs, writes and counts the failures the steps' samples carry."""

    def __init__(
        self,
        run_dir: str | Path | None,
        warnings_per_kind: int = 3,
        max_rate: float = 0.5,
        window_steps: int = 3,
        resume_step: int | None = None,
    ) -> None:
        self.path = Path(run_dir) / "failures.jsonl" if run_dir is not None else None
        self.warnings_per_kind, self.max_rate, self.window_steps = warnings_per_kind, max_rate, window_steps
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[tuple[str, str]] = Counter()
        self.samples = self.failed = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=max(1, window_steps))
        if self.path is not None and self.path.exists():  # a resumed run keeps the rows of the steps it kept
            keep = resume_step if resume_step is not None else -1
            rows = [ln for ln in self.path.read_text(encoding="utf-8").splitlines() if ln.strip()]
            kept = [ln for ln in rows if json.loads(ln).get("step", 0) <= keep]
            self.path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")

    def record(self, step: int, samples: list[Any]) -> list[dict[str, Any]]:
        """Log, write and count the step's failures; raise :class:`FailureRateError` past the threshold."""
        rows = []
        for sample in samples:
            for entry in sample.metadata.get("failures", ()):
                rows.append(
                    {
                        "kind": entry["kind"],
                        "step": step,
                        "id": sample_id(sample),
                        "reason": entry["reason"],
                        **({"traceback": entry["traceback"]} if entry.get("traceback") else {}),
                    }
                )
        self.add(step, rows)
        failed = sum(any(e["kind"] in SAMPLE_KINDS for e in s.metadata.get("failures", ())) for s in samples)
        self.samples += len(samples)
        self.failed += failed
        self._window.append((failed, len(samples)))
        if len(self._window) == self._window.maxlen:
            self.check(
                f"over the last {len(self._window)} step(s)", *map(sum, zip(*self._window, strict=True))
            )
        return rows

    def add(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Failures not tied to a sample (an engine lost mid-step) join the same log: ``kind``, ``id``, ``reason``."""
        by_kind: Counter[str] = Counter()
        for row in rows:
            kind = row["kind"]
            by_kind[kind] += 1
            self.counts[kind] += 1
            self.reasons[(kind, _headline(row["reason"]))] += 1
            if by_kind[kind] <= self.warnings_per_kind:
                log.warning("relax: step %d: %s failed (%s): %s", step, kind, row["id"], row["reason"])
        for kind, n in by_kind.items():
            if n > self.warnings_per_kind:
                top = Counter(_headline(r["reason"], 100) for r in rows if r["kind"] == kind).most_common(2)
                log.warning(
                    "relax: step %d: %d more %s failures (top reasons: %s); all of them in %s",
                    step,
                    n - self.warnings_per_kind,
                    kind,
                    "; ".join(f"{c}x {r}" for r, c in top),
                    self.path,
                )
        if rows and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(r, default=str) + "\n" for r in rows))

    def check(self, where: str, failed: int, total: int) -> None:
        if total and failed / total > self.max_rate:
            raise FailureRateError(
                f"{failed} of {total} samples failed {where} (more than logging.fail_if_failure_rate_above="
                f"{self.max_rate:g}); top reason: {self.top(1)[0] if self.reasons else 'unknown'}"
                + (f"; every failure in {self.path}" if self.path else "")
            )

    def finish(self) -> None:
        """End of the run: the whole run's rate is checked too (a run shorter than the window)."""
        self.check("in this run", self.failed, self.samples)

    def top(self, n: int = 3) -> list[str]:
        return [f"{count}x {kind}: {reason}" for (kind, reason), count in self.reasons.most_common(n)]

    def summary(self) -> dict[str, Any]:
        """For the run's end summary: counts per kind, the top reasons, and where every failure is."""
        return {
            "counts": dict(self.counts),
            "failed_samples": self.failed,
            "samples": self.samples,
            "top_reasons": self.top(),
            "path": str(self.path) if self.path else None,
        }


def format_summary(summary: dict[str, Any] | None) -> list[str]:
    """Console lines of :meth:`FailureLog.summary` (none when nothing failed)."""
    if not summary or not summary.get("counts"):
        return []
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(summary["counts"].items()))
    lines = [
        f"relax: failures: {counts} ({summary['failed_samples']} of {summary['samples']} samples lost their score); "
        f"all in {summary['path']}"
    ]
    lines += [f"relax:   {reason}" for reason in summary["top_reasons"]]
    return lines
