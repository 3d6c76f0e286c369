"""A recipe's CPU smoke inputs: ``inputs: {name: <dataset>-smoke}`` builds, on first use and cached, the tiny
model its CPU variant runs and the dataset's fixture rows converted by its real converter (``relax data prepare
<dataset> --smoke``) with their held-out file (the recipe's ``eval.sets.heldout``), so ``relax run
examples/recipes/<recipe>_smoke.yaml`` works from a fresh clone. The plugin that registers the dataset registers
them too, from its ``relax_register_inputs``, with :func:`register_smoke_inputs` and the tiny model it builds."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.core.recipes.catalog import dataset_of
from relax.core.recipes.prepare import SMOKE_ROWS, build_smoke

_FORMAT = (
    2  # bump when a converter or fixture changes: names the cache directory, so stale data is not reused
)
MEDIA_ROOT = "data.processor_params.media_root"


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


def quickstart_model(models: Path) -> str:
    """The tiny text model of a text recipe's smoke variant: core's quick-start model (its own cache)."""
    from relax.core.quickstart_model import ensure_quickstart_model

    return ensure_quickstart_model()


def fills(media: bool) -> tuple[str, ...]:
    return ("model.path", "data.path", *((MEDIA_ROOT,) if media else ()), "eval.sets.heldout.path")


def smoke_inputs(
    dataset: str, model: Callable[[Path], str], params: SmokeInputsParams, media: bool
) -> dict[str, str]:
    """Build (or find) the smoke model and data of ``dataset``; the config values they fill."""
    spec = dataset_of(dataset)
    root = cache_root()
    data_dir = build_smoke(spec.name, root, params.rows)
    made = {
        "model.path": str(model(root / "models")),
        "data.path": str(data_dir / "train.jsonl"),
        "eval.sets.heldout.path": str(data_dir / spec.heldout_file),
    }
    if media:  # the rows name their media relative to the prepared directory
        made[MEDIA_ROOT] = str(data_dir)
    return made


def register_smoke_inputs(
    register: Any, dataset: str, model: Callable[[Path], str], media: bool = False
) -> None:
    """Register inputs ``<dataset>-smoke``: ``model(models_dir) -> path`` builds the tiny model (cached under
    ``models_dir``; :func:`quickstart_model` for text); ``media``: the rows carry media files, so the inputs
    also fill ``data.processor_params.media_root``."""

    def build(params: SmokeInputsParams, ctx: Any) -> dict[str, str]:
        return smoke_inputs(dataset, model, params, media)

    register(f"{dataset}-smoke", build, config=SmokeInputsParams, fills=fills(media))
