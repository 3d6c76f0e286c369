"""The ``python`` tool: run untrusted code in a fresh, limited process per call.

Each call gets its own ``python -I`` process in a new session, a fresh temporary working directory,
and (set up in the child before the code runs, see ``sandbox_child.py``):

- wall-time limit: the whole process group is killed (and, as root, every process of the call's
  own uid, so a child that left the group dies too);
- CPU time, address space (memory), file size, open files: ``resource.setrlimit``;
- processes: ``RLIMIT_NPROC``; as root that limit is ignored, so the child switches to a uid of its
  own (unique per call) first, which also takes away root's file access;
- network: a new empty network namespace (``unshare(CLONE_NEWNET)``, in a user namespace when not
  root) and, where the kernel has Landlock ABI >= 4, TCP bind/connect denied;
- files: Landlock (Linux >= 5.13) allows reading only the Python installation and system library
  directories and writing only the working directory.

What is not isolated is reported per call (``SandboxResult.isolation``) and documented in
``docs/agents-tools.md``: without Landlock, world-readable files can be read; without namespaces,
the network is reachable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from relax.agents.config import SandboxLimits
from relax.agents.tools import ToolError

_CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass
class SandboxResult:
    exit_code: int | None  # None: killed by the wall-time limit
    stdout: str
    stderr: str
    timed_out: bool = False
    elapsed_s: float = 0.0
    #: what was enforced: network, files, processes (False = not isolated here; ``*_error``: why not)
    isolation: dict[str, bool | str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` under ``limits``; never raises for what the code does."""
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="relax-sandbox-"))
    try:
        return _run_in(root, code, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, code: str, limits: SandboxLimits) -> SandboxResult:
    work = root / "work"
    work.mkdir(mode=0o700)  # not even listable by a concurrent call (another uid) when Landlock is missing
    (work / "main.py").write_text(code, encoding="utf-8", errors="replace")
    as_root = os.geteuid() == 0
    uid = 200_000 + secrets.randbelow(1 << 30) if as_root else None
    if uid is not None:  # the call's own uid must reach and own its working directory
        os.chmod(root, 0o711)
        for path in (work, work / "main.py"):
            os.chown(path, uid, uid)
    config = {
        "limits": dataclasses.asdict(limits),
        "uid": uid,
        "work": str(work),
        "status": str(root / "status.json"),
        "nproc_base": 0 if as_root else _tasks_of(os.getuid()),
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }
    started = time.monotonic()
    with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(_CHILD), json.dumps(config)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            close_fds=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_all(proc, uid)
    try:
        isolation = json.loads((root / "status.json").read_text())
    except (OSError, ValueError):
        isolation = {}
    return SandboxResult(
        None if timed_out else proc.returncode,
        _read(root / "stdout", limits.max_output_bytes),
        _read(root / "stderr", limits.max_output_bytes, tail=True),
        timed_out,
        time.monotonic() - started,
        isolation,
    )


def _read(path: Path, limit: int, tail: bool = False) -> str:
    """The first (or, for ``tail``, last) ``limit`` bytes, marked when there was more."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if tail and size > limit:
            f.seek(size - limit)
        data = f.read(limit)
    text = data.decode("utf-8", errors="replace")
    if size <= limit:
        return text
    return "[output truncated]\n" + text if tail else text + "\n[output truncated]"


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    """The child, its process group and (as root) every process running as the call's uid."""
    for _ in range(20):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        stray = _pids_of(uid) if uid is not None else []
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if proc.poll() is not None and not stray:
            break
        time.sleep(0.01)
    proc.wait()


def _status_uids(pid: str) -> tuple[int, int] | None:
    """(real uid, number of threads) of a /proc entry, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    uid = threads = 0
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return uid, threads


def _pids_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _status_uids(entry)) and info[0] == uid:
            found.append(int(entry))
    return found


def _tasks_of(uid: int) -> int:
    """Threads (what RLIMIT_NPROC counts) the uid runs now: a non-root limit must sit above them."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _status_uids(entry)) and info[0] == uid:
            total += info[1]
    return total


def describe_failure(result: SandboxResult, limits: SandboxLimits) -> str:
    """The error observation for a failed run: why it stopped, then the end of its output."""
    if result.timed_out:
        why = f"killed: wall-time limit of {limits.wall_s:g}s exceeded"
    elif result.exit_code is not None and result.exit_code < 0:
        sig = -result.exit_code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        why = {
            "SIGXCPU": f"killed: CPU-time limit of {limits.cpu_s}s exceeded",
            "SIGKILL": f"killed (SIGKILL): CPU-time limit of {limits.cpu_s}s or memory limit of {limits.memory_mb} MB",
        }.get(name, f"killed by {name}")
    elif result.exit_code == 120:
        why = "the sandbox could not be set up"
    else:
        why = f"exit code {result.exit_code}"
    tail = result.stderr.strip()[-1500:]
    out = result.stdout.strip()[-1000:]
    return why + (f"\nstdout:\n{out}" if out else "") + (f"\nstderr:\n{tail}" if tail else "")


def python_tool(limits: SandboxLimits) -> object:
    """The ``python`` tool over :func:`run_python`: stdout on success, an error naming why otherwise."""
    from relax.agents.tools import FunctionTool

    def python(code: str) -> str:
        result = run_python(code, limits)
        if not result.ok:
            raise ToolError(describe_failure(result, limits))
        return result.stdout if result.stdout else "(no output; print() what you want to see)"

    description = (
        "Run a Python program in a fresh sandboxed process and return what it prints to stdout. "
        f"Limits: {limits.wall_s:g}s wall time, {limits.memory_mb} MB memory, no network, "
        "files only in its own working directory."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program"}},
        "required": ["code"],
        "additionalProperties": False,
    }
    return FunctionTool("python", description, parameters, python)
