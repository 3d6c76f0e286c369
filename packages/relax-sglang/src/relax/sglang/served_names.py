"""Trained weight names against the served model's loader.

SGLang serves Qwen3-Omni as the whole ``Qwen3OmniMoeForConditionalGeneration``: its ``load_weights`` takes
checkpoint names under ``thinker.`` and the checkpoint's expert layout, and skips a name it does not hold (a log
line in the server, nothing in the reply). Relax's trainers export the thinker as transformers holds it in memory
(``model.*``, ``model.audio_tower.*``, fused experts): such an update would leave every weight as it was under the
new version, or kill the server on an expert's shape. Until the export is mapped to that layout, the engine
refuses it, naming the transport and what to use instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

#: served architecture -> the prefix its loader expects on every name
WRAPPED = {"Qwen3OmniMoeForConditionalGeneration": "thinker."}


def served_architecture(model_path: str) -> str | None:
    """The architecture a server launched from ``model_path`` runs, if it is one :data:`WRAPPED` names (None for
    the others, and for a path that is not a local checkpoint directory)."""
    try:
        architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return next((a for a in architectures if a in WRAPPED), None)


def check_served_names(names: Iterable[str], architecture: str | None, engine: str) -> None:
    """Raise ``ValueError`` when ``names`` are not what the wrapped ``architecture``'s loader takes."""
    if architecture is None:
        return
    stray = next((n for n in names if not n.startswith(WRAPPED[architecture])), None)
    if stray is not None:
        raise ValueError(refusal(architecture, engine, repr(stray)))


def refusal(architecture: str, engine: str, got: str) -> str:
    return (f"{engine}: the server runs {architecture}, whose loader takes checkpoint names under "
            f"{WRAPPED[architecture]!r} (got {got}): a trained Qwen3-Omni thinker cannot be synced into SGLang yet; "
            "use rollout.engine: hf for it")
