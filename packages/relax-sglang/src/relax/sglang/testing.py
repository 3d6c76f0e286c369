"""Test helpers: the SGLang server environment (built once, cached) and one shared server per process.

A server takes ~30-90 s to start on a small CPU machine, so tests share one per model directory
(``shared_engine``) and only a test that must kill a server starts its own.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from relax.sglang.params import SGLangEngineParams

BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "build_server_env.sh"
BUILD_TIMEOUT_S = 1800.0

_lock = threading.Lock()
_python: str | None = None
_shared: dict[str, Any] = {}


class ServerEnvError(RuntimeError):
    """The SGLang server environment could not be built (the message ends with the build log's tail)."""


def server_python(log_path: str | os.PathLike[str] | None = None) -> str:
    """The server environment's interpreter: ``$RELAX_SGLANG_PYTHON``, else built (or reused) by
    ``scripts/build_server_env.sh``. A failed or timed-out build raises with the log's tail."""
    global _python
    with _lock:
        if _python is None:
            _python = os.environ.get("RELAX_SGLANG_PYTHON") or _build(Path(log_path or "sglang-server-env-build.log"))
        return _python


def _build(log: Path) -> str:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        try:
            done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=err, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            done = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    if done is None or done.returncode != 0:
        why = f"timed out after {BUILD_TIMEOUT_S:g}s" if done is None else f"failed (exit {done.returncode})"
        raise ServerEnvError(f"building the SGLang server env with {BUILD_SCRIPT} {why}; log {log}:\n{tail}")
    return done.stdout.strip().splitlines()[-1]


def engine_params(**overrides: Any) -> SGLangEngineParams:
    """Engine params for tests: the built server env, CPU, short timeouts."""
    base = dict(python=server_python(), startup_timeout_s=600.0, control_timeout_s=120.0, request_timeout_s=300.0)
    return SGLangEngineParams(**{**base, **overrides})


def shared_engine(model_dir: str, run_dir: str, **overrides: Any) -> Any:
    """One launched ``SGLangEngine`` per model directory for the whole process (closed at exit)."""
    from relax.sglang.engine import SGLangEngine

    with _lock:
        engine = _shared.get(model_dir)
    if engine is None:
        engine = SGLangEngine(engine_params(**overrides), model_dir, run_dir=run_dir)
        with _lock:
            _shared[model_dir] = engine
    return engine


def close_shared() -> None:
    with _lock:
        engines = list(_shared.values())
        _shared.clear()
    for engine in engines:
        engine.close()


atexit.register(close_shared)
