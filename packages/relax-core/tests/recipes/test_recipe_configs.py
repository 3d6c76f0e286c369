"""The recipe configs: the repository's examples are exactly what ``relax init --recipe`` writes, every one
validates, and each smoke variant is its recipe with only sizes, backends and inputs changed -- so the suite's
smoke runs exercise the recipe's own algorithm, reward and data format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax.core.config import load_config
from relax.core.plugins import get_plugin_manager
from relax.core.recipes import DATASETS, RECIPES
from relax.core.recipes.starter import template

REPO = Path(__file__).resolve().parents[4]

# fields a smoke variant may change: where it runs and how big it is, never what it trains
SMOKE_MAY_CHANGE = (
    "name",
    "run_dir",
    "total_steps",
    "mode",
    "max_staleness",
    "inputs.",
    "model.",
    "data.path",
    "data.processor_params.media_root",
    "data.processor_params.min_pixels",
    "data.processor_params.max_pixels",
    "rollout.engine",
    "rollout.engine_params",
    "rollout.num_engines",
    "rollout.prompts_per_step",
    "rollout.n_samples_per_prompt",
    "rollout.max_new_tokens",
    "trainer.backend",
    "trainer.backend_params",
    "trainer.micro_batch_size",
    "algorithm.critic.warmup_steps",
    "weight_sync.",
    "checkpoint.",
    "logging.",
    "ray.",
    "eval.sets.heldout.path",
    "cluster.",
    "trainer.recompute",
    "trainer.max_tokens_per_micro_batch",
)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_example_is_the_template(name):
    recipe = RECIPES[name]
    assert (REPO / recipe.example).read_text() == template(recipe.template), (
        f"{recipe.example} drifted from relax/core/recipes/configs/{recipe.template}: edit one, copy it to the other"
    )
    header = template(recipe.template).split("\nname:")[0]
    assert "GPUs" in header and recipe.hardware.split(" (")[0] in header  # the hardware it is sized for
    assert f"relax data prepare {recipe.dataset}" in header and recipe.smoke in header


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_smoke_variant_changes_only_sizes(name):
    recipe = RECIPES[name]
    full = flat(load_config(REPO / recipe.example).to_dict())
    smoke_cfg = load_config(REPO / recipe.smoke)
    smoke = flat(smoke_cfg.to_dict())
    changed = sorted(k for k in full.keys() | smoke.keys() if full.get(k) != smoke.get(k))
    unexpected = [k for k in changed if not k.startswith(SMOKE_MAY_CHANGE)]
    assert not unexpected, {k: (full.get(k), smoke.get(k)) for k in unexpected}
    for key in (
        "algorithm.advantage_estimator",
        "algorithm.policy_loss",
        "reward.name",
        "data.prompt_key",
        "data.label_key",
        "data.processor",
    ):
        assert full[key] == smoke[key], key  # spelled out: the point of the smoke variant
    spec = DATASETS[recipe.dataset]
    assert smoke_cfg.inputs.name == f"{spec.name}-smoke" and smoke_cfg.model.path is None
    assert full["reward.name"] == spec.reward
    assert smoke_cfg.rollout.engine == "hf" and smoke_cfg.total_steps <= 3  # seconds on CPU
    # its eval set: the prepared held-out file in the full recipe, the fixture's (built by inputs) in the smoke
    assert full["eval.sets.heldout.path"] == f"data/{spec.name}/{spec.heldout_file}"
    assert smoke["eval.sets.heldout.path"] is None and smoke_cfg.eval.before_train and smoke_cfg.eval.at_end


def test_smoke_inputs_are_registered_with_what_they_fill():
    manager = get_plugin_manager()
    for spec in DATASETS.values():
        reg = manager.registration("inputs", f"{spec.name}-smoke")
        media = ("data.processor_params.media_root",) if spec.media else ()
        fills = ("model.path", "data.path", *media, "eval.sets.heldout.path")
        assert reg.options["fills"] == fills and reg.plugin == "core"


def test_every_recipe_file_validates():
    files = sorted((REPO / "examples" / "recipes").glob("*.yaml"))
    assert len(files) == 5  # the PPO recipe and four smoke variants
    for path in [*files, *(REPO / r.example for r in RECIPES.values())]:
        load_config(path)
