"""A process pool that survives its work: a call that hangs is killed, a worker that dies is replaced.

Why not ``concurrent.futures.ProcessPoolExecutor``: one worker calling ``os._exit`` breaks the whole
executor (every pending future fails, no new work is accepted), and a stuck call cannot be stopped
at all. math-verify times out with ``SIGALRM``, which works only in a process's main thread, so it
cannot run in the reward actor's threads either. Here each worker is a fresh process serving one
call at a time over its own pipe, in its main thread; the caller waits at most ``timeout_s`` and on
expiry SIGKILLs that worker and starts a fresh one (the other workers keep serving).

Workers receive the objects they serve once, when spawned (``targets``: name -> picklable object
with a ``score(sample)`` method, plain or async); a call names its target and passes one argument.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


class CallTimeout(TimeoutError):
    """The call ran past its wall-clock limit; its worker was killed and replaced."""


class WorkerDied(RuntimeError):
    """The worker process exited during the call (``os._exit``, a segfault, the OOM killer)."""


class RemoteError(RuntimeError):
    """The target raised in the worker; the message carries the worker's traceback summary."""


def _serve(conn: Any) -> None:
    """Worker main: read ``(sys.path, targets)``, warm targets up, then answer ``(name, arg)`` calls."""
    try:
        paths, payload = pickle.loads(conn.recv_bytes())
        sys.path.extend(p for p in paths if p not in sys.path)  # after ours: never shadow what we import
        targets: dict[str, Any] = pickle.loads(payload)
        # calls carry relax Samples, whose module imports torch (1.5 s or more): import it during start-up
        # (start_timeout_s), not inside the first call's timeout_s, which it would eat on a fresh worker
        import relax.core.data  # noqa: F401

        for target in targets.values():
            warm = getattr(target, "warm_up", None)
            if callable(warm):
                warm()
    except BaseException as e:  # noqa: BLE001  # reported to the parent, which fails loudly
        conn.send(("error", f"worker start-up failed: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            name, arg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            fn = targets[name].score
            value = asyncio.run(fn(arg)) if inspect.iscoroutinefunction(fn) else fn(arg)
            reply = ("ok", value)
        except BaseException as e:  # noqa: BLE001  # any failure goes back to the caller
            reply = ("error", traceback.format_exception_only(type(e), e)[-1].strip())
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            conn.send(("error", f"result of {name!r} cannot be sent back: {e}"))


def child_main(fd: int) -> None:
    """Entry of ``python -c`` in a worker: serve on the inherited socket ``fd``."""
    _serve(Connection(fd))


class _Worker:
    """A fresh interpreter (not multiprocessing's spawn, which re-imports the parent's ``__main__``:
    a Ray worker's, a REPL's) talking over a socket pair."""

    def __init__(self, payload: bytes, index: int) -> None:
        parent, child = socket.socketpair()
        code = "import sys; from relax.rewards.pool import child_main; child_main(int(sys.argv[1]))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send_bytes(pickle.dumps((list(sys.path), payload)))
        self.ready = False
        self.index = index

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exitcode(self) -> int | None:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise WorkerDied(f"reward worker pid {self.pid} did not start within {timeout_s:g}s")
        try:
            kind, detail = self.conn.recv()
        except EOFError:
            raise WorkerDied(
                f"reward worker pid {self.pid} exited during start-up (exit code {self.exitcode()})"
            ) from None
        if kind != "ready":
            raise RuntimeError(detail)
        self.ready = True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.exitcode()
        self.conn.close()


class ProcessPool:
    """``size`` spawned workers serving ``targets``; ``call`` is blocking and thread-safe, ``acall``
    awaits it from any event loop (in a daemon thread, so an abandoned call never blocks a loop)."""

    def __init__(self, targets: Mapping[str, Any], size: int = 2, start_timeout_s: float = 120.0) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        try:
            self._payload = pickle.dumps(dict(targets))
        except Exception as e:
            raise TypeError(f"reward targets must be picklable to run in worker processes: {e}") from e
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._spawned = 0
        self.start_timeout_s = start_timeout_s
        self.size = size
        self.restarts = 0
        self._closed = False
        for _ in range(size):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        with self._lock:
            worker = _Worker(self._payload, self._spawned)
            self._spawned += 1
            self._all.append(worker)
            return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            self.restarts += 1
        if not self._closed:
            self._idle.put(self._spawn())

    def call(self, name: str, arg: Any, timeout_s: float, wait_s: float | None = None) -> Any:
        """``targets[name].score(arg)`` in a worker, at most ``timeout_s`` of run time. Waits up to
        ``wait_s`` (default: ``start_timeout_s``) for a free, started worker first."""
        if self._closed:
            raise RuntimeError("the reward process pool is closed")
        wait = self.start_timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait
        try:
            worker = self._idle.get(timeout=wait)
        except queue.Empty:
            raise CallTimeout(f"no free reward worker within {wait:g}s") from None
        try:
            worker.wait_ready(max(1.0, deadline - time.monotonic()))
        except (WorkerDied, RuntimeError):  # died, or its start-up (unpickling, warm-up) failed
            self._replace(worker)
            raise
        try:
            message = pickle.dumps((name, arg))
        except Exception:
            self._idle.put(worker)
            raise
        try:
            worker.conn.send_bytes(message)
            if not worker.conn.poll(timeout_s):
                self._replace(worker)
                raise CallTimeout(f"killed after {timeout_s:g}s (worker pid {worker.pid} replaced)")
            kind, value = worker.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = worker.exitcode()
            self._replace(worker)
            raise WorkerDied(f"worker pid {worker.pid} exited with code {code} during the call") from None
        self._idle.put(worker)
        if kind == "error":
            raise RemoteError(value)
        return value

    async def acall(self, name: str, arg: Any, timeout_s: float, wait_s: float | None = None) -> Any:
        from relax.core.rewards.bounded import in_daemon_thread

        return await in_daemon_thread(self.call, name, arg, timeout_s, wait_s)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for w in workers:
            w.kill()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ProcessPool lives in one process and cannot be pickled; build it where it is used")
