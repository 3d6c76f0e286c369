"""The recipes and their datasets: which published dataset each trains on, how it is converted, which
config runs it and on what hardware, and how its CPU smoke variant is built."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.core.recipes import avqa, dapo_math, openr1_vl
from relax.core.recipes.output import Output
from relax.core.recipes.sources import SourceError, SourceRow, data_files, is_hub_id, iter_file, iter_hub

Converter = Callable[[SourceRow, Output], tuple[dict[str, Any], str | None]]


def read_published(source: str, split: str, out_dir: Path) -> Iterator[SourceRow]:
    """Rows of a Parquet / JSONL dataset: a Hub id through ``datasets``, else the split's files under a path."""
    if is_hub_id(source):
        yield from iter_hub(source, split)
        return
    root = Path(source)
    files = data_files(root, split)
    if not files:
        raise SourceError(f"{source}: no .parquet/.jsonl/.json files")
    for file in files:
        yield from iter_file(file, root if root.is_dir() else file.parent)


@dataclass(frozen=True)
class DatasetSpec:
    """A published dataset and its converter into Relax rows."""

    name: str
    hub_id: str
    summary: str
    reward: str  # the relax-rewards reward its rows are labelled for
    convert: Converter
    write_fixture: Callable[[Path, int], Path]  # fixture rows in the published layout under a directory
    smoke_model: str  # the tiny model of the smoke variant: "quickstart" (text) or a multimodal family
    read: Callable[[str, str, Path], Iterator[SourceRow]] = read_published
    # the published split its recipe evaluates on (``relax data prepare <name> --split <it>``); None: the
    # dataset has none, and ``relax data prepare <name> --heldout N`` carves N rows out of training instead
    heldout_split: str | None = None
    heldout_rows: int = 0  # else: how many rows its recipes carve out (``--heldout``)

    @property
    def media(self) -> bool:
        return self.smoke_model != "quickstart"

    @property
    def heldout_file(self) -> str:
        """The file name of the held-out rows in the prepared directory (the recipes' ``eval.sets.heldout``)."""
        return f"{self.heldout_split or 'heldout'}.jsonl"


@dataclass(frozen=True)
class Recipe:
    """A training recipe: a config (shipped in the package, copied to ``example`` in the repository) over one
    dataset, sized for ``hardware``; ``smoke`` is its CPU variant on tiny models (run by the test suite)."""

    name: str
    dataset: str
    model: str  # the Hub model the config is written for
    hardware: str
    template: str  # file name under relax/core/recipes/configs/
    example: str  # the copy in the repository, relative to its root
    smoke: str  # the CPU smoke config in the repository
    modes: tuple[str, ...] = ("colocate", "async", "hybrid")  # what ``relax init --mode`` may write
    # relax init --mode: dotted fields that change with the mode (besides mode and max_staleness)
    mode_fields: dict[str, dict[str, Any]] = field(default_factory=dict)


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            dapo_math.NAME,
            dapo_math.HUB_ID,
            "17k competition math problems, answer on an 'Answer:' line",
            "math",
            dapo_math.convert,
            dapo_math.write_fixture,
            "quickstart",
            heldout_rows=500,
        ),
        DatasetSpec(
            openr1_vl.NAME,
            openr1_vl.HUB_ID,
            "7.7k image + math question pairs, <answer> solutions",
            "openr1_mm",
            openr1_vl.convert,
            openr1_vl.write_fixture,
            "qwen3_vl",
            heldout_rows=200,
        ),
        DatasetSpec(
            avqa.NAME,
            avqa.HUB_ID,
            "6.4k image + audio multiple-choice questions (4 options)",
            "multiple_choice",
            avqa.convert,
            avqa.write_fixture,
            "qwen3_omni",
            read=avqa.read,
            heldout_split="valid",
        ),
    )
}

_GPU_COLOCATE = {  # trainer and SGLang servers take turns on the same GPUs: weights handed over by CUDA IPC
    "rollout.release_memory": True,
    # the trainer's weights and optimizer state stay on the GPU while SGLang generates (docs/memory-plan.md)
    "rollout.engine_params.mem_fraction_static": 0.5,
    "weight_sync.transport": "sglang_tensor",
    "weight_sync.params": {},
}

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "dapo-math-grpo",
            dapo_math.NAME,
            "Qwen/Qwen3-4B",
            "1 node x 8 GPUs (80 GB)",
            "dapo_math_grpo.yaml",
            "examples/qwen3_4b_grpo_math.yaml",
            "examples/recipes/dapo_math_grpo_smoke.yaml",
            mode_fields={"colocate": _GPU_COLOCATE},
        ),
        Recipe(
            "dapo-math-ppo",
            dapo_math.NAME,
            "Qwen/Qwen3-4B",
            "1 node x 8 GPUs (141 GB, H200)",
            "dapo_math_ppo.yaml",
            "examples/recipes/qwen3_4b_ppo_math.yaml",
            "examples/recipes/dapo_math_ppo_smoke.yaml",
            mode_fields={"colocate": _GPU_COLOCATE},
        ),
        Recipe(
            "openr1-vl-grpo",
            openr1_vl.NAME,
            "Qwen/Qwen3-VL-4B-Instruct",
            "1 node x 8 GPUs (80 GB)",
            "openr1_vl_grpo.yaml",
            "examples/omni/qwen3_vl_4b_grpo.yaml",
            "examples/recipes/openr1_vl_grpo_smoke.yaml",
            mode_fields={"colocate": _GPU_COLOCATE},
        ),
        Recipe(
            "avqa-omni-grpo",
            avqa.NAME,
            "Qwen/Qwen3-Omni-30B-A3B-Instruct",
            "2 nodes x 8 GPUs (80 GB)",
            "avqa_omni_grpo.yaml",
            "examples/omni/qwen3_omni_30b_a3b_grpo.yaml",
            "examples/recipes/avqa_omni_grpo_smoke.yaml",
            modes=("async", "hybrid"),
        ),
    )
}


def dataset_of(name: str) -> DatasetSpec:
    """A dataset by its name, or by the name of a recipe that trains on it."""
    if name in RECIPES:
        name = RECIPES[name].dataset
    if name not in DATASETS:
        raise KeyError(
            f"unknown recipe or dataset {name!r}; datasets: {', '.join(DATASETS)}; "
            f"recipes: {', '.join(RECIPES)}"
        )
    return DATASETS[name]
