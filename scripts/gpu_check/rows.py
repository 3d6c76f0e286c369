"""Rows of the GPU check's table from a ``pytest -v`` log: one per test, also when the file's time limit cut
pytest off (then no junit report exists). Pure text in, rows out; ``tests/test_gpu_check.py`` runs it on CPU.

    python scripts/gpu_check/rows.py LOG FILE_ID [TIMED_OUT_AFTER_S]   # prints "name<TAB>result<TAB>seconds"

pytest -v prints a test's id when it starts and its outcome on the same line when it ends, and with ``-rs``
each skip's reason in the closing summary (in the order of the skips); ``--durations=0`` prints each test's seconds. A test whose id is
printed without an outcome was running when the limit hit: TIMED OUT. Tests collected (``collected N items``)
but never started are counted in one row, "not run"."""

from __future__ import annotations

import re
import sys

OUTCOME = re.compile(r"^(?P<id>\S+::\S+?)(?: <- \S+)? (?P<out>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
STARTED = re.compile(r"^(?P<id>\S+::\S+)\s*$")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] (?P<where>[^:]+):\d+: (?P<why>.*)$")
FAILURE = re.compile(r"^(?:FAILED|ERROR) (?P<id>\S+::\S+?) - (?P<why>.*)$")
DURATION = re.compile(r"^(?P<s>[\d.]+)s call\s+(?P<id>\S+::\S+)$")
COLLECTED = re.compile(r"collected (?P<n>\d+) items?(?: / (?P<desel>\d+) deselected)?")


def rows(log: str, file_id: str, timed_out_after: float | None = None) -> list[tuple[str, str, str]]:
    results: dict[str, str] = {}
    started: list[str] = []
    skips: list[str] = []  # the summary's reasons, in the order the tests were skipped
    failures: dict[str, str] = {}
    seconds: dict[str, str] = {}
    collected = 0
    for line in log.splitlines():
        line = line.rstrip()
        if m := OUTCOME.match(line):
            results[m["id"]] = m["out"]
            started.append(m["id"])
        elif m := STARTED.match(line):
            started.append(m["id"])
        elif m := SKIP_REASON.match(line):
            skips.append(m["why"])
        elif m := FAILURE.match(line):
            failures[m["id"]] = m["why"]
        elif m := DURATION.match(line):
            seconds[m["id"]] = f"{float(m['s']):.0f}"
        elif m := COLLECTED.search(line):
            collected = int(m["n"]) - int(m["desel"] or 0)
    out = []
    skipped = [t for t in dict.fromkeys(started) if results.get(t) == "SKIPPED"]
    reason = dict(zip(skipped, skips, strict=True)) if len(skipped) == len(skips) else {}
    for test in dict.fromkeys(started):
        name = f"  {file_id}::{test.split('::', 1)[1]}"
        outcome = results.get(test)
        if outcome is None:
            result = (
                f"TIMED OUT (running when the {timed_out_after:.0f}s limit hit)"
                if timed_out_after
                else "no outcome"
            )
        elif outcome == "SKIPPED":
            result = "skipped: " + reason.get(test, "")[:90]
        elif outcome in ("FAILED", "ERROR"):
            result = f"{outcome}: {failures.get(test, '')[:90]}".rstrip(": ")
        else:
            result = outcome.lower()
        out.append((name, result, seconds.get(test, "")))
    if (missing := collected - len(set(started))) > 0:
        out.append((f"  {file_id}: {missing} more", "not run (the file's time limit hit first)", ""))
    return out


if __name__ == "__main__":
    text = open(sys.argv[1], errors="replace").read()
    limit = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    for row in rows(text, sys.argv[2], limit):
        print("\t".join(row))
