"""The three recipes of Relax (text math PPO/GRPO on Qwen3-4B with DAPO-Math-17k, vision-language GRPO on
Qwen3-VL-4B with multimodal-open-r1-8k-verified, omni GRPO on Qwen3-Omni-30B-A3B with AVQA-R1-6K): dataset
converters from each published schema (``relax data prepare``), the configs (``configs/``, written by
``relax init --recipe``) and their CPU smoke variants on tiny models. See docs/recipes.md."""

from relax.core.recipes.catalog import DATASETS, RECIPES, DatasetSpec, Recipe, dataset_of
from relax.core.recipes.output import PrepareReport, RowError
from relax.core.recipes.prepare import build_smoke, prepare, prepare_smoke

__all__ = [
    "DATASETS",
    "RECIPES",
    "DatasetSpec",
    "PrepareReport",
    "Recipe",
    "RowError",
    "build_smoke",
    "dataset_of",
    "prepare",
    "prepare_smoke",
]
