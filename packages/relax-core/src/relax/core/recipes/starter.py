"""``relax init``: a commented starter config -- the quick-start template, or a recipe's config -- for the
chosen mode, validated before it is written (a combination that would not load is never written)."""

from __future__ import annotations

import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from relax.core.errors import ConfigError
from relax.core.recipes.catalog import Recipe, recipe_of
from relax.core.recipes.yaml_edit import set_field

MODES = ("colocate", "async", "hybrid")
STARTER = "starter.yaml"
# what init writes for each mode: (mode line comment, max_staleness, its comment)
MODE_LINES = {
    "colocate": ("trainer and rollout take turns on the same devices", 0, "colocate is strictly on-policy"),
    "async": (
        "rollout, training and the queue roles run at once on separate devices",
        1,
        "rollout may run one policy version ahead of training",
    ),
    "hybrid": (
        "rollout apart; reference, old logprobs and advantages inside the trainer",
        1,
        "rollout may run one policy version ahead of training",
    ),
}


def template(recipe: str | None = None) -> str:
    """The config a recipe registered (its plugin ships it), or core's starter (``relax/core/recipes/configs``)."""
    if recipe is not None:
        return _recipe(recipe).template()
    return resources.files("relax.core.recipes").joinpath("configs", STARTER).read_text()


def _recipe(recipe: str) -> Recipe:
    try:
        return recipe_of(recipe)
    except KeyError as exc:
        raise ConfigError(f"--recipe: {exc.args[0]}") from None


def default_file(recipe: str | None) -> str:
    return "relax.yaml" if recipe is None else f"{recipe}.yaml"


def starter_text(recipe: str | None = None, mode: str | None = None) -> str:
    """The config ``relax init`` writes: a recipe's (``--recipe``) or the starter, switched to ``mode``."""
    spec = _recipe(recipe) if recipe else None
    text = spec.template() if spec else template()
    if mode is None:
        return text
    if mode not in MODES:
        raise ConfigError(f"--mode: {mode!r} is not one of {', '.join(MODES)}")
    if spec is not None and mode not in spec.modes:
        raise ConfigError(
            f"--mode: recipe {recipe!r} is written for mode {' or '.join(spec.modes)} "
            f"(its sizing does not carry over to {mode})"
        )
    note, staleness, staleness_note = MODE_LINES[mode]
    text = set_field(text, "mode", mode, note=note)
    text = set_field(text, "max_staleness", staleness, note=staleness_note)
    for dotted, value in (spec.mode_fields.get(mode, {}) if spec else {}).items():
        text = set_field(text, dotted, value)
    return text


def validate_text(text: str) -> Any:
    """Load ``text`` as a config (plugins, names, ranges; not whether its model and data exist yet)."""
    from relax.core.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "relax.yaml"
        path.write_text(text)
        return load_config(path)


def write_starter(
    out: str | Path, recipe: str | None = None, mode: str | None = None, force: bool = False
) -> Path:
    """Write the validated starter config to ``out``; refuses to overwrite an existing file unless ``force``."""
    path = Path(out)
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; pass --force to overwrite it, or --out another file")
    text = starter_text(recipe, mode)
    validate_text(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
