"""Function tools run in worker processes, so that a call past its timeout is killed, not abandoned.

A Python thread cannot be stopped: a tool that hangs in a thread keeps its CPU (and memory) for the
rest of the run. Here each call runs in a ``python -m relax.agents.tool_worker`` child (the tool and
its arguments pickled over a pipe: a module-level function travels by its import path); a call that
overruns its timeout gets its worker SIGKILLed, and the next call starts a fresh one. Idle workers are
reused (up to ``max_idle`` kept), so a call costs a round trip, not a process start.
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

_HEADER = struct.Struct("!Q")


class ToolTimeout(Exception):
    """The call did not return within its timeout; its worker process was killed."""


class ToolCrashed(Exception):
    """The worker process died during the call (a segfault, ``os._exit``, the OOM killer)."""


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("tool worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    return pickle.loads(stream.read(size))


class _Worker:
    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # tools import as here
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relax.agents.tool_worker", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        if self.proc.stdout.read(1) != b"R":  # started: a call's timeout never counts the interpreter's start
            self.kill()
            raise ToolCrashed(f"a tool worker process did not start (exit code {self.proc.returncode})")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)  # the tool's own children too
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class ToolWorkers:
    """Runs ``function(**arguments)`` in a worker process, bounded by ``timeout_s``. Thread-safe."""

    def __init__(self, timeout_s: float, max_idle: int = 4, preload: tuple[str, ...] = ()) -> None:
        """``preload``: modules each worker imports before it counts as started (the tools' own), so that
        a call's timeout never counts importing them."""
        self.timeout_s, self.max_idle, self.preload = timeout_s, max_idle, tuple(preload)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def call(self, function: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        """The call's value; its exception re-raised; :class:`ToolTimeout` / :class:`ToolCrashed` when it
        overran or its process died. Raises ``pickle.PicklingError`` (before starting anything) for a
        function that cannot travel (a lambda, a closure): run those with ``tool_workers: thread``."""
        payload = pickle.dumps((function, arguments), protocol=pickle.HIGHEST_PROTOCOL)
        worker = self._take()
        try:
            worker.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
            worker.proc.stdin.flush()
            reply = self._reply(worker)
        except BaseException:
            self._discard(worker)
            raise
        self._give(worker)
        ok, value = reply
        if ok:
            return value
        raise value

    def _reply(self, worker: _Worker) -> tuple[bool, Any]:
        box: list[Any] = []

        def read() -> None:
            try:
                box.append(_recv(worker.proc.stdout))
            except BaseException as exc:  # noqa: BLE001 - a dead worker: reported below
                box.append(exc)

        reader = threading.Thread(target=read, daemon=True, name="tool-worker-read")
        reader.start()
        reader.join(self.timeout_s)
        if reader.is_alive():  # overran: the process is killed, which ends the read too
            raise ToolTimeout(f"did not finish within {self.timeout_s:g}s (its process was killed)")
        (reply,) = box
        if isinstance(reply, BaseException):
            try:
                code = worker.proc.wait(timeout=5)  # its pipe closed: it is exiting
            except subprocess.TimeoutExpired:
                code = None
            raise ToolCrashed(f"its worker process died (exit code {code})") from reply
        return reply

    def reserve(self, n: int) -> None:
        """Have ``n`` idle workers ready, started at once: a turn's calls then start on a warm process and
        their timeouts count the call only, not an interpreter's start."""
        with self._lock:
            missing = max(0, n - len(self._idle))
        started: list[_Worker] = []
        threads = [
            threading.Thread(target=lambda: started.append(_Worker(self.preload)), daemon=True)
            for _ in range(missing)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._lock:
            if self._closed:
                for worker in started:
                    worker.kill()
                return
            self._idle.extend(started)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("tool workers are closed (the run ended)")
            worker = None
            while self._idle and worker is None:
                candidate = self._idle.pop()
                if candidate.proc.poll() is None:
                    worker = candidate
                else:
                    candidate.kill()
        if worker is None:
            worker = _Worker(self.preload)  # outside the lock: other calls start theirs at the same time
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(worker)
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()

    def pids(self) -> list[int]:
        """The worker processes alive now (tests, diagnostics)."""
        with self._lock:
            return [w.proc.pid for w in [*self._idle, *self._busy] if w.proc.poll() is None]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
            self._busy.clear()
        for worker in workers:
            worker.kill()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a ``RuntimeError`` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """The worker's loop: one call at a time until the pipe closes."""
    while True:
        try:
            function, arguments = _recv(inp)
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, function(**arguments))
        except BaseException as exc:  # noqa: BLE001 - the policy reads what went wrong
            reply = (False, _portable(exc))
        try:
            pickle.dumps(reply)
        except Exception:  # noqa: BLE001 - an unpicklable value: its repr is the observation
            reply = (True, repr(reply[1]))
        _send(out, reply)


if __name__ == "__main__":
    stdout = sys.stdout.buffer
    sys.stdout = sys.stderr  # a tool's print() must not corrupt the reply pipe
    for name in sys.argv[1:]:  # the tools' modules, before the call's clock starts
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the call itself reports what is wrong
            pass
    stdout.write(b"R")
    stdout.flush()
    serve(sys.stdin.buffer, stdout)
