"""Recipes and datasets as plugins register them: ``relax init --recipe`` writes a recipe's config, ``relax data
prepare`` converts a dataset from its published schema, and ``<dataset>-smoke`` inputs build a recipe's CPU
smoke variant. Core holds the machinery (registry, sources, output, YAML editing, fixtures) and names no recipe;
a plugin registers its own with ``relax_register_recipes`` / ``relax_register_datasets``. See docs/recipes.md."""

from relax.core.recipes.catalog import (
    GPU_COLOCATE,
    DatasetSpec,
    Recipe,
    dataset_of,
    datasets,
    packaged,
    recipe_of,
    recipes,
)
from relax.core.recipes.output import Output, PrepareReport, RowError, media_extension
from relax.core.recipes.prepare import build_smoke, prepare, prepare_smoke
from relax.core.recipes.smoke import quickstart_model, register_smoke_inputs
from relax.core.recipes.sources import SourceError, SourceRow

__all__ = [
    "GPU_COLOCATE",
    "DatasetSpec",
    "Output",
    "PrepareReport",
    "Recipe",
    "RowError",
    "SourceError",
    "SourceRow",
    "build_smoke",
    "dataset_of",
    "datasets",
    "media_extension",
    "packaged",
    "prepare",
    "prepare_smoke",
    "quickstart_model",
    "recipe_of",
    "recipes",
    "register_smoke_inputs",
]
