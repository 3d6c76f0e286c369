"""The SGLang server's environment: ``$RELAX_SGLANG_PYTHON``, else the cached CPU venv that
``scripts/build_server_env.sh`` builds from ``server/uv.lock`` on first use (``engine_params.python: auto``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from pathlib import Path

_PACKAGED = Path(__file__).resolve().parent / "server_files" / "scripts" / "build_server_env.sh"  # in a wheel
_SOURCE = Path(__file__).resolve().parents[3] / "scripts" / "build_server_env.sh"  # in the source tree
#: the server env's build script, with the lock and CPU shims beside it (shipped in the wheel: python: auto
#: works from an installed relax-sglang, not only from a checkout)
BUILD_SCRIPT = _PACKAGED if _PACKAGED.is_file() else _SOURCE
BUILD_TIMEOUT_S = 1800.0

_lock = threading.Lock()
_python: str | None = None


class ServerEnvError(RuntimeError):
    """The SGLang server environment could not be built (the message ends with the build log's tail)."""


def server_python(log_path: str | os.PathLike[str] | None = None) -> str:
    """The server environment's interpreter: ``$RELAX_SGLANG_PYTHON``, else built (or reused) by
    ``scripts/build_server_env.sh``. A failed or timed-out build raises with the log's tail."""
    global _python
    with _lock:
        if _python is None:
            default = (
                Path(tempfile.gettempdir()) / "relax-sglang-server-env-build.log"
            )  # not the caller's cwd
            _python = os.environ.get("RELAX_SGLANG_PYTHON") or _build(Path(log_path or default))
        return _python


def _build(log: Path) -> str:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        try:
            done = subprocess.run(
                ["bash", str(BUILD_SCRIPT)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            done = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    if done is None or done.returncode != 0:
        why = f"timed out after {BUILD_TIMEOUT_S:g}s" if done is None else f"failed (exit {done.returncode})"
        raise ServerEnvError(f"building the SGLang server env with {BUILD_SCRIPT} {why}; log {log}:\n{tail}")
    return done.stdout.strip().splitlines()[-1]
