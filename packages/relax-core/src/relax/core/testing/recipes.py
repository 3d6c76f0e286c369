"""Checks a plugin runs on the recipes and datasets it registers (``relax_register_recipes`` / ``_datasets``):
the repository's example is exactly what ``relax init --recipe`` writes, every mode it offers validates, its
smoke variant is the recipe with only sizes, backends and inputs changed (so the suite's smoke run exercises the
recipe's own algorithm, reward and data format), and every dataset converts its own fixture rows, skipping the
malformed ones by reason. relax-rewards and relax-omni run them on theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
# what a smoke variant spells out unchanged: the point of it
SMOKE_KEEPS = (
    "algorithm.advantage_estimator",
    "algorithm.policy_loss",
    "reward.name",
    "data.prompt_key",
    "data.label_key",
    "data.processor",
)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def check_example_is_the_template(name: str, repo: Path) -> None:
    """The repository's copy is the registered config, whose header says its hardware, data and smoke variant."""
    from relax.core.recipes import recipe_of

    recipe = recipe_of(name)
    text = recipe.template()
    assert (repo / recipe.example).read_text() == text, (
        f"{recipe.example} drifted from the config {recipe.package} registers for {name}: edit one, copy it "
        "to the other"
    )
    header = text.split("\nname:")[0]
    assert "GPUs" in header and recipe.hardware.split(" (")[0] in header  # the hardware it is sized for
    assert f"relax data prepare {recipe.dataset}" in header and recipe.smoke in header


def check_offered_modes_validate(name: str) -> None:
    """``relax init --recipe name --mode M`` validates for every mode the recipe offers, comments kept."""
    from relax.core.recipes import recipe_of
    from relax.core.recipes.starter import starter_text, validate_text

    recipe = recipe_of(name)
    for mode in (None, *recipe.modes):
        text = starter_text(name, mode)
        cfg = validate_text(text)
        assert cfg.mode == (mode or yaml.safe_load(recipe.template())["mode"])
        assert cfg.max_staleness == (0 if cfg.mode == "colocate" else 1)
        assert text.startswith("# ") and text.count("\n#") >= 3  # the commentary survives the edit
        for dotted, value in recipe.mode_fields.get(mode or "", {}).items():
            assert flat(cfg.to_dict()).get(dotted, {}) == value, (name, mode, dotted)


def check_smoke_variant_changes_only_sizes(name: str, repo: Path) -> None:
    """The smoke config differs from the recipe only in :data:`SMOKE_MAY_CHANGE`; its inputs build its data."""
    from relax.core.config import load_config
    from relax.core.plugins import get_plugin_manager
    from relax.core.recipes import dataset_of, recipe_of

    recipe = recipe_of(name)
    full = flat(load_config(repo / recipe.example).to_dict())
    smoke_cfg = load_config(repo / recipe.smoke)
    smoke = flat(smoke_cfg.to_dict())
    changed = sorted(k for k in full.keys() | smoke.keys() if full.get(k) != smoke.get(k))
    unexpected = [k for k in changed if not k.startswith(SMOKE_MAY_CHANGE)]
    assert not unexpected, {k: (full.get(k), smoke.get(k)) for k in unexpected}
    for key in SMOKE_KEEPS:
        assert full[key] == smoke[key], key
    spec = dataset_of(name)
    assert smoke_cfg.inputs.name == f"{spec.name}-smoke" and smoke_cfg.model.path is None
    inputs = get_plugin_manager().registration("inputs", smoke_cfg.inputs.name)
    assert set(inputs.options["fills"]) >= {"model.path", "data.path", "eval.sets.heldout.path"}
    assert full["reward.name"] == spec.reward
    assert smoke_cfg.rollout.engine == "hf" and smoke_cfg.total_steps <= 3  # seconds on CPU
    # its eval set: the prepared held-out file in the full recipe, the fixture's (built by inputs) in the smoke
    assert full["eval.sets.heldout.path"] == f"data/{spec.name}/{spec.heldout_file}"
    assert smoke["eval.sets.heldout.path"] is None and smoke_cfg.eval.before_train and smoke_cfg.eval.at_end


def check_dataset_converts_its_fixture(name: str, out: Path) -> Any:
    """``relax data prepare name --smoke``: the good fixture rows converted, the malformed ones skipped by
    reason, with the recipe's held-out file; returns the report."""
    from relax.core.recipes import dataset_of, prepare_smoke

    spec = dataset_of(name)
    report = prepare_smoke(name, out, rows=2, heldout=2)
    assert report.rows == 2 and sum(report.skipped.values()) >= 2, (name, report)
    assert (out / spec.heldout_file).is_file() and report.dataset == spec.name
    return report
