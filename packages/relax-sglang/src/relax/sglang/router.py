"""An ``sglang-router`` (SGLang's Rust router) in front of one engine's SGLang servers (``router: sglang``).

With core's router every Relax engine is one server and requests go to the least loaded one. With SGLang's
router, one Relax engine owns several servers and a router process in front of them: ``/generate`` goes
through the router (cache-aware by default: requests that share a prefix land where it is cached), control
calls (pause, weight updates, memory) go to every server directly. The router runs from an interpreter
that has the ``sglang-router`` package (``router_python``; ``auto`` looks in this environment, then in
the server's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from relax.sglang.params import SGLangEngineParams
from relax.sglang.server import ServerError, ServerProcess, free_port

ROUTER_ENV = "RELAX_SGLANG_ROUTER_PYTHON"
_PROBE = "import sglang_router"


class RouterMissing(ServerError):
    """No interpreter with the ``sglang-router`` package was found (the message says where it looked)."""


def router_command(params: SGLangEngineParams, python: str, worker_urls: list[str], port: int) -> list[str]:
    """The ``sglang_router.launch_router`` command line fronting ``worker_urls`` (pure: unit-tested). Its
    request timeout follows the engine's, so the router never cuts a long generation the engine waits for."""
    return [
        python,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        params.router_policy,
        "--host",
        params.host,
        "--port",
        str(port),
        "--request-timeout-secs",
        str(int(params.request_timeout_s)),
        "--worker-startup-timeout-secs",
        str(int(params.startup_timeout_s)),
        "--log-level",
        "warn",
        *params.router_args,
    ]


def has_router(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", _PROBE], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def router_python(params: SGLangEngineParams, server_python: str | None = None) -> str:
    """The interpreter to run the router with: ``params.router_python`` unless ``auto``; then
    ``$RELAX_SGLANG_ROUTER_PYTHON``, this interpreter, or the server environment's -- the first that
    imports ``sglang_router``. None of them: :class:`RouterMissing`."""
    if params.router_python != "auto":
        return params.router_python
    candidates = [os.environ.get(ROUTER_ENV), sys.executable, server_python]
    for python in dict.fromkeys(c for c in candidates if c):
        if has_router(python):
            return python
    raise RouterMissing(
        "sglang-router not installed: rollout.engine_params.router 'sglang' needs the sglang-router package "
        f"(pip install sglang-router==0.3.2) in one of {[c for c in candidates if c]}, or set {ROUTER_ENV} / "
        "engine_params.router_python to an interpreter that has it"
    )


class RouterProcess(ServerProcess):
    """The router as a child process: same start/health/stop handling as a server (its own session, dies
    with the engine, named in every error)."""

    interpreter = "router_python"
    interpreter_hint = "an environment with the sglang-router package"

    def __init__(
        self, params: SGLangEngineParams, python: str, worker_urls: list[str], log_path: Path, index: int = 0
    ):
        super().__init__(params, "", "", log_path, index)
        self.python, self.worker_urls = python, list(worker_urls)
        self.port = free_port(params.host)  # engine_params.port numbers the servers
        self.url = f"http://{params.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"sglang router[{self.index}] at {self.url}"

    def command(self) -> list[str]:
        return router_command(self.params, self.python, self.worker_urls, self.port)

    def ready(self) -> bool:
        """Healthy, and routing to every server: the router answers /health before it has registered its
        workers (an early request would find none)."""
        if not super().ready():
            return False
        workers = requests.get(f"{self.url}/workers", timeout=5).json().get("workers", [])
        healthy = {w.get("url", "").rstrip("/") for w in workers if w.get("is_healthy", True)}
        return {u.rstrip("/") for u in self.worker_urls} <= healthy

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the router's interpreter must not see Relax's site-packages
        return env
