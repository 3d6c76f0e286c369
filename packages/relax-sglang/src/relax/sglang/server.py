"""One SGLang server as a child process: command line, start, health wait, log capture, clean stop.

The server runs from its own environment (``python`` in the engine params), in its own session, so
stopping it takes its scheduler/detokenizer children with it (no orphans) and frees its port, and with
Relax's server patches (``relax.sglang.server_site``) on its ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

from relax.sglang.device_defaults import cuda_attention_backend, server_settings
from relax.sglang.media import video_model_type, video_server_args
from relax.sglang.params import SGLangEngineParams
from relax.sglang.server_site import SITE_DIR

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 30


class ServerError(RuntimeError):
    """An SGLang server failed to start, died, or did not answer in time (the message names it)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_command(
    params: SGLangEngineParams,
    model_path: str,
    port: int,
    dtype: str,
    video: str | None = None,
    base_gpu: int = 0,
) -> list[str]:
    """The ``sglang.launch_server`` command line for ``params`` (pure: unit-tested); ``video``: the model type
    of a model the engine sends video, so the server re-processes our rebuilt frames exactly (unless
    ``extra_args`` configure it). ``dtype``: the run's; unset params take their device's defaults
    (:func:`relax.sglang.device_defaults.server_settings`). ``base_gpu``: the first of the engine's GPUs this
    server uses (several servers behind one sglang-router each take their own ``tp_size``)."""
    settings = server_settings(params, dtype)
    cmd = [
        params.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        params.host,
        "--port",
        str(port),
        "--device",
        params.device,
        "--dtype",
        settings.dtype,
        "--mem-fraction-static",
        str(params.mem_fraction_static),
        "--tp-size",
        str(params.tp_size),
        "--skip-server-warmup",
    ]
    if settings.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(settings.max_total_tokens)]
    if settings.deterministic:
        cmd += ["--enable-deterministic-inference"]
    if base_gpu and params.device.startswith("cuda"):
        cmd += ["--base-gpu-id", str(base_gpu)]
    if params.memory_saver and params.device.startswith("cuda"):
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    if params.device == "cpu":  # what runs without sgl-kernel (see server/cpu_shims)
        cmd += [
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
            "--sleep-on-idle",
        ]  # an idle CPU scheduler otherwise spins a whole core
    attention = cuda_attention_backend(params.device, settings.dtype)
    if (
        attention and "--attention-backend" not in params.extra_args
    ):  # float32 on CUDA (an explicit choice wins)
        cmd += ["--attention-backend", attention]
    if video and "--mm-process-config" not in params.extra_args:
        cmd += video_server_args(params.video_fps, video)
    return cmd + list(params.extra_args)


def server_env(params: SGLangEngineParams) -> dict[str, str]:
    """The server's environment: ours without Relax's ``PYTHONPATH`` (the server's venv must not see Relax's
    site-packages), led instead by the server patches' directory (``relax.sglang.server_site``), then
    ``params.env`` (a ``PYTHONPATH`` there goes after the patches)."""
    env = dict(os.environ)
    # the server's three processes each import torch + sglang: with bytecode written on the first launch, a
    # later one imports in ~25 s instead of ~57 (2 cores); a PYTHONDONTWRITEBYTECODE inherited from the
    # caller would recompile every module on every launch
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if params.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.update(params.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), params.env.get("PYTHONPATH")) if p)
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A launched SGLang server; ``name`` (``sglang engine[i] at URL``) appears in every error."""

    interpreter = "python"  # the engine_params field naming the interpreter (in errors)
    interpreter_hint = "the SGLang server environment (packages/relax-sglang/scripts/build_server_env.sh)"

    def __init__(
        self,
        params: SGLangEngineParams,
        model_path: str,
        dtype: str,
        log_path: Path,
        index: int = 0,
        base_gpu: int = 0,
    ):
        self.params, self.model_path, self.dtype, self.index, self.base_gpu = (
            params,
            model_path,
            dtype,
            index,
            base_gpu,
        )
        self.log_path = Path(log_path)
        self.port = params.port + index if params.port else free_port(params.host)
        self.url = f"http://{params.host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return f"sglang engine[{self.index}] at {self.url}"

    def command(self) -> list[str]:
        video = video_model_type(self.model_path)
        return server_command(self.params, self.model_path, self.port, self.dtype, video, self.base_gpu)

    def environment(self) -> dict[str, str]:
        return server_env(self.params)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(cmd)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.environment(),
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except FileNotFoundError as exc:
                raise ServerError(
                    f"{self.name}: cannot run engine_params.{self.interpreter} {cmd[0]!r} ({exc}); point it at "
                    f"{self.interpreter_hint}"
                ) from exc
        self.wait_healthy(self.params.startup_timeout_s)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; log {self.log_path}:\n"
                    + log_tail(self.log_path)
                )
            try:
                if self.ready():
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"{self.name} was not healthy within {timeout_s:g}s; log {self.log_path}:\n"
                    + log_tail(self.log_path)
                )
            time.sleep(HEALTH_POLL_S)

    def ready(self) -> bool:
        """Serving (polled while starting; a connection error counts as not yet)."""
        return requests.get(f"{self.url}/health", timeout=5).status_code == 200

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after a grace period; idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own process group
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(pgid):
                break
            time.sleep(0.5)
        if _group_alive(pgid):  # children that outlived the leader (scheduler, detokenizer)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(STOP_GRACE_S)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the engine's process dies, even by SIGKILL (``ray.kill``), so a server
    never outlives its engine actor (SGLang's own subprocesses follow their launcher). Linux only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def live_group_members(pgid: int) -> list[int]:
    """Pids of the process group that still run (zombies excluded: where PID 1 does not reap, as in some
    containers, an exited child stays a zombie in the group)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            pids.append(int(stat.parent.name))
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(live_group_members(pgid))
