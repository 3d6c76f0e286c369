"""The recipes and datasets the installed plugins register (``relax_register_recipes``,
``relax_register_datasets``): which published dataset a recipe trains on, how that dataset is converted, which
config runs it and on what hardware. Core ships the machinery and names no recipe: the seed recipes come with the
package that owns what they need (the text math ones with relax-rewards, the media ones with relax-omni)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from relax.core.recipes.output import Output
from relax.core.recipes.sources import SourceError, SourceRow, data_files, is_hub_id, iter_file, iter_hub

Converter = Callable[[SourceRow, Output], tuple[dict[str, Any], str | None]]
# where the seed recipes live, for the error on a recipe no installed plugin registers (package names only)
SEED_PACKAGES = (
    "relax-rewards (the text math recipes and datasets)",
    "relax-omni (the vision-language and audio-visual ones)",
)
# GPU colocate mode for an SGLang recipe: trainer and servers take turns on the same GPUs, weights by CUDA IPC
GPU_COLOCATE: dict[str, Any] = {
    "rollout.release_memory": True,
    # the trainer's weights and optimizer state stay on the GPU while SGLang generates (docs/memory-plan.md)
    "rollout.engine_params.mem_fraction_static": 0.5,
    "weight_sync.transport": "sglang_tensor",
    "weight_sync.params": {},
}


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


def packaged(package: str, path: str) -> Callable[[], str]:
    """A loader of a text file shipped in ``package`` (``packaged("relax.omni.recipes", "configs/x.yaml")``):
    what a recipe registers as its config template and model shape, read only when used."""

    def read() -> str:
        return resources.files(package).joinpath(path).read_text()

    return read


@dataclass(frozen=True)
class DatasetSpec:
    """A published dataset and its converter into Relax rows (``relax_register_datasets``)."""

    name: str
    convert: Converter
    hub_id: str
    summary: str
    reward: str  # the reward its rows are labelled for
    write_fixture: Callable[[Path, int], Path]  # fixture rows in the published layout under a directory
    read: Callable[[str, str, Path], Iterator[SourceRow]] = read_published
    # the published split its recipe evaluates on (``relax data prepare <name> --split <it>``); None: the
    # dataset has none, and ``relax data prepare <name> --heldout N`` carves N rows out of training instead
    heldout_split: str | None = None
    heldout_rows: int = 0  # else: how many rows its recipes carve out (``--heldout``)
    package: str = "?"  # the distribution that registered it

    @property
    def heldout_file(self) -> str:
        """The file name of the held-out rows in the prepared directory (the recipes' ``eval.sets.heldout``)."""
        return f"{self.heldout_split or 'heldout'}.jsonl"


@dataclass(frozen=True)
class Recipe:
    """A training recipe (``relax_register_recipes``): a config over one dataset, sized for ``hardware``;
    ``example`` is its copy in the repository, ``smoke`` its CPU variant on tiny models (run by the suite)."""

    name: str
    template: Callable[[], str]  # the config text ``relax init --recipe`` writes
    dataset: str
    model: str  # the Hub model the config is written for
    hardware: str
    example: str  # relative to the repository's root
    smoke: str
    modes: tuple[str, ...] = ("colocate", "async", "hybrid")  # what ``relax init --mode`` may write
    # relax init --mode: dotted fields that change with the mode (besides mode and max_staleness)
    mode_fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_config: Callable[[], str] | None = None  # the model's config.json: its memory plan before download
    package: str = "?"

    def shape(self) -> dict[str, Any] | None:
        return json.loads(self.model_config()) if self.model_config is not None else None


def _collect(kind: str, cls: type, texts: tuple[str, ...]) -> dict[str, Any]:
    """``cls`` of every ``kind`` registration; a malformed one is an error naming its plugin."""
    from relax.core.plugins import PluginError, get_plugin_manager

    manager = get_plugin_manager()
    found = {}
    for name in manager.names(kind):
        reg = manager.registration(kind, name)
        package = manager.infos[reg.plugin].distribution if reg.plugin in manager.infos else reg.plugin
        try:
            found[name] = cls(name, reg.factory, **reg.options, package=package)
        except TypeError as exc:  # a missing or unknown keyword of register(...)
            raise PluginError(f"plugin {reg.plugin!r}: {kind} {name!r}: {exc}") from None
        if bad := [
            t for t in texts if not (isinstance(getattr(found[name], t), str) and getattr(found[name], t))
        ]:
            raise PluginError(
                f"plugin {reg.plugin!r}: {kind} {name!r}: {', '.join(bad)} must be non-empty texts"
            )
    return found


def datasets() -> dict[str, DatasetSpec]:
    """Every registered dataset, by name."""
    return _collect("dataset", DatasetSpec, ("hub_id", "summary", "reward"))


def recipes() -> dict[str, Recipe]:
    """Every registered recipe, by name."""
    return _collect("recipe", Recipe, ("dataset", "model", "hardware", "example", "smoke"))


def not_installed(what: str, name: str, known: dict[str, Any]) -> str:
    """The error for a name no installed plugin registers: what is installed, and where the seed ones come from."""
    have = ", ".join(f"{n} ({s.package})" for n, s in known.items()) or "(none installed)"
    return (
        f"unknown {what} {name!r}; installed: {have}. Recipes and datasets come with the plugin package that "
        f"ships them: install it (uv pip install <package>); the seed ones are in {' and '.join(SEED_PACKAGES)}"
    )


def recipe_of(name: str) -> Recipe:
    """A recipe by name; an unknown one is a ``KeyError`` naming the packages that ship recipes."""
    found = recipes()
    if name not in found:
        raise KeyError(not_installed("recipe", name, found))
    return found[name]


def dataset_of(name: str) -> DatasetSpec:
    """A dataset by its name, or by the name of a recipe that trains on it."""
    found, by_recipe = datasets(), recipes()
    if name in by_recipe:
        recipe = by_recipe[name]
        if recipe.dataset not in found:
            raise KeyError(
                f"recipe {name!r} ({recipe.package}) trains on dataset {recipe.dataset!r}, which no installed "
                f"plugin registers; {not_installed('dataset', recipe.dataset, found)}"
            )
        name = recipe.dataset
    if name not in found:
        raise KeyError(not_installed("recipe or dataset", name, {**found, **by_recipe}))
    return found[name]


def listing() -> str:
    """``relax init --list``: every installed recipe and dataset with the package that provides it."""
    lines = ["recipes (relax init --recipe NAME):"]
    for r in recipes().values():
        lines.append(f"  {r.name:<20} {r.package:<14} {r.model} on {r.dataset}; sized for {r.hardware}")
    lines.append("datasets (relax data prepare NAME):")
    for d in datasets().values():
        lines.append(f"  {d.name:<32} {d.package:<14} {d.hub_id}: {d.summary}")
    return "\n".join(lines)
