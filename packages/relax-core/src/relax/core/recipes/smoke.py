"""The recipes' smoke inputs: ``inputs: {name: <dataset>-smoke}`` builds, on first use and cached, the tiny
model a recipe's CPU variant runs (core's quick-start model for text, ``relax.core.testing.multimodal_models``'
tiny Qwen3-VL / Qwen3-Omni thinker for media) and the dataset's fixture rows converted by its real converter
(``relax data prepare <dataset> --smoke``) with their held-out file (the recipe's ``eval.sets.heldout``), so ``relax run examples/recipes/<recipe>_smoke.yaml`` works from a
fresh clone. Registered by core (``relax_register_inputs`` in ``relax.core.builtin``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.core.recipes.catalog import DATASETS, DatasetSpec
from relax.core.recipes.prepare import SMOKE_ROWS, build_smoke

_FORMAT = (
    2  # bump when a converter or fixture changes: names the cache directory, so stale data is not reused
)


@dataclass(frozen=True)
class SmokeInputsParams:
    """``inputs.params`` of the ``<dataset>-smoke`` inputs."""

    rows: int = SMOKE_ROWS  # good fixture rows (a few malformed ones are added, and skipped by the converter)

    def validate(self) -> list[str]:
        return [] if self.rows >= 1 else [f"rows: must be >= 1, got {self.rows}"]


def cache_root() -> Path:
    """``$RELAX_CACHE_DIR`` (default ``~/.cache/relax``) ``/recipes-smoke-v<format>``."""
    root = Path(os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")
    return root / f"recipes-smoke-v{_FORMAT}"


def fills(spec: DatasetSpec) -> tuple[str, ...]:
    media = ("data.processor_params.media_root",) if spec.media else ()
    return ("model.path", "data.path", *media, "eval.sets.heldout.path")


def smoke_inputs(spec: DatasetSpec, params: SmokeInputsParams) -> dict[str, str]:
    """Build (or find) the smoke model and data of ``spec``; the config values they fill."""
    root = cache_root()
    data_dir = build_smoke(spec.name, root, params.rows)
    if spec.smoke_model == "quickstart":
        from relax.core.quickstart_model import ensure_quickstart_model

        model = ensure_quickstart_model()
    else:
        from relax.core.testing.multimodal_models import WHOLE_OMNI, tiny_multimodal_dir, tiny_whole_omni_dir

        # an Omni recipe trains the whole checkpoint as released: so does its smoke variant (the thinker inside)
        tiny = tiny_whole_omni_dir if spec.smoke_model in WHOLE_OMNI else tiny_multimodal_dir
        model = tiny(root / "models", spec.smoke_model)
    made = {
        "model.path": model,
        "data.path": str(data_dir / "train.jsonl"),
        "eval.sets.heldout.path": str(data_dir / spec.heldout_file),
    }
    if spec.media:
        made["data.processor_params.media_root"] = str(data_dir)
    return made


def register_smoke_inputs(register: Any) -> None:
    for spec in DATASETS.values():

        def build(params: SmokeInputsParams, ctx: Any, spec: DatasetSpec = spec) -> dict[str, str]:
            return smoke_inputs(spec, params)

        register(f"{spec.name}-smoke", build, config=SmokeInputsParams, fills=fills(spec))
