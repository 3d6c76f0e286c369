"""Test helpers: the SGLang server environment (built once, cached) and one shared server per process.

A server takes ~30-90 s to start on a small CPU machine, so tests share one per model directory
(``shared_engine``) and only a test that must kill a server starts its own.
"""

from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import Any

from relax.sglang.params import SGLangEngineParams
from relax.sglang.server_env import ServerEnvError, server_python

__all__ = [
    "ServerEnvError",
    "close_shared",
    "engine_params",
    "load_weights",
    "server_python",
    "shared_engine",
    "tiny_omni_dirs",
]

_lock = threading.Lock()
_shared: dict[str, Any] = {}


def engine_params(**overrides: Any) -> SGLangEngineParams:
    """Engine params for tests: the built server env, CPU, short timeouts."""
    base = dict(
        python=server_python(), startup_timeout_s=900.0, control_timeout_s=120.0, request_timeout_s=300.0
    )
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


def tiny_omni_dirs(root: str | Path, seed: int = 1) -> tuple[str, str]:
    """(server dir, thinker dir): a seeded tiny Qwen3-Omni thinker as SGLang 0.5.23 serves it (a
    ``Qwen3OmniMoeForConditionalGeneration`` checkpoint wrapping ``thinker.*``) and as HF loads it.

    From the kit's tiny ``qwen3_omni``, with three vision layers, each a deepstack index: SGLang's Qwen3-VL-MoE
    language model adds exactly three deepstack slices (``range(3)``), and the kit's one index crashes its
    forward (a repeated index gives video embeddings of the wrong width)."""
    import json
    import shutil

    import torch
    import transformers

    from relax.omni.tiny_models import tiny_multimodal_dir, wrap_whole_omni

    target = Path(root) / f"relax-tiny-sglang-qwen3_omni-seed{seed}"
    thinker = target / "thinker"
    if (target / "config.json").exists():
        return str(target), str(thinker)
    base = Path(tiny_multimodal_dir(root, "qwen3_omni", seed))
    config = json.loads((base / "config.json").read_text())
    config["vision_config"].update(depth=3, deepstack_visual_indexes=[0, 1, 2])
    fields = {
        k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")
    }
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(
        transformers.Qwen3OmniMoeThinkerConfig(**fields)
    )
    tmp = Path(f"{target}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "thinker")
    for name in (
        "chat_template.jinja",
        "generation_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        shutil.copy(base / name, tmp / "thinker" / name)
    wrap_whole_omni(tmp / "thinker", tmp, "qwen3_omni")
    tmp.rename(target)
    return str(target), str(thinker)


def close_shared() -> None:
    with _lock:
        engines = list(_shared.values())
        _shared.clear()
    for engine in engines:
        engine.close()


atexit.register(close_shared)
