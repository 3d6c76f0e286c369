"""Test helpers: the SGLang server environment (built once, cached) and one shared server per process.

A server takes ~30-90 s to start on a small CPU machine, so tests share one per model directory
(``shared_engine``) and only a test that must kill a server starts its own.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from relax.sglang.params import SGLangEngineParams
from relax.sglang.server_env import ServerEnvError, server_python

__all__ = ["ServerEnvError", "close_shared", "engine_params", "load_weights", "server_python", "shared_engine"]

_lock = threading.Lock()
_shared: dict[str, Any] = {}


def engine_params(**overrides: Any) -> SGLangEngineParams:
    """Engine params for tests: the built server env, CPU, short timeouts."""
    base = dict(python=server_python(), startup_timeout_s=900.0, control_timeout_s=120.0, request_timeout_s=300.0)
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


def load_weights(engine: Any, model_dir: str, version: int) -> None:
    """Serve the checkpoint in ``model_dir`` as ``version`` (tests restore the shared server's weights)."""
    from relax.core.testing.models import load_hf_weights

    engine.begin_weight_update(version)
    engine.update_weights(list(load_hf_weights(model_dir).items()), version)
    engine.end_weight_update(version)


def close_shared() -> None:
    with _lock:
        engines = list(_shared.values())
        _shared.clear()
    for engine in engines:
        engine.close()


atexit.register(close_shared)
