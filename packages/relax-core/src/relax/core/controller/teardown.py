"""Tear an embedded Ray down completely: no raylet, GCS, agent or worker of the run left behind.

``ray.shutdown()`` stops the processes it started, but agents and workers that were busy (or
stopped) can outlive it for minutes. Every process of an embedded Ray descends from the driver,
so we record Ray's descendants before the shutdown and kill whichever survive a grace period.
Linux ``/proc`` only; elsewhere this degrades to plain ``ray.shutdown()``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("relax")

GRACE_S = 5.0


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (to tell a reused pid apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[1], []).append(int(entry.name))
            starts[int(entry.name)] = st[2]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def is_ray_process(pid: int) -> bool:
    """Ray's daemons run from the ray package; its workers and agents are titled ``ray::...``."""
    cmd = _cmdline(pid)
    return cmd.startswith("ray::") or f"{os.sep}ray{os.sep}" in cmd


def ray_processes(root: int | None = None) -> dict[int, int]:
    """Ray processes descending from ``root`` (default: this process): pid -> start time."""
    return {p: t for p, t in descendants(os.getpid() if root is None else root).items() if is_ray_process(p)}


def alive(pids: dict[int, int]) -> list[int]:
    """The pids in ``pids`` that still run (same start time, not a zombie)."""
    out = []
    for pid, start in pids.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[0] != "Z":
            out.append(pid)
    return out


def reap(pids: dict[int, int], grace_s: float = GRACE_S) -> list[int]:
    """Wait up to ``grace_s`` for ``pids`` to exit, then SIGKILL the rest (stopped ones too).
    Returns the pids that had to be killed."""
    deadline = time.monotonic() + grace_s
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        log.warning(
            "relax: killed %d Ray process(es) that outlived ray.shutdown(): %s", len(left), sorted(left)
        )
    return left


def shutdown_ray(grace_s: float = GRACE_S) -> None:
    """``ray.shutdown()`` and make sure every Ray process this driver started is gone."""
    import ray

    pids = ray_processes()
    try:
        ray.shutdown()
    finally:
        reap(pids, grace_s)
