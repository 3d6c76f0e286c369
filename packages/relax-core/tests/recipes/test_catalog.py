"""Recipes and datasets are what plugins register (``relax_register_recipes`` / ``_datasets``): core lists them
with the package that provides them, names the packages that ship the seed ones when a recipe is not installed,
refuses a malformed registration naming its plugin, and builds a recipe's smoke inputs and memory-plan shape
from what the plugin registered."""

from __future__ import annotations

import json

import pytest
from toy_recipes import install, toy_plugin  # tests/recipes/toy_recipes.py, on sys.path by conftest

from relax.core.cli import main
from relax.core.config import load_config
from relax.core.memory_plan.source import bundled_config
from relax.core.plugins import PluginError
from relax.core.recipes import dataset_of, datasets, recipe_of, recipes
from relax.core.recipes.smoke import SmokeInputsParams


def test_init_list_shows_each_recipe_and_dataset_with_its_package(toy_recipes, capsys):
    assert main(["init", "--list"]) == 0
    out = capsys.readouterr().out
    assert (
        "toy-grpo             (in-process)   owner/Toy-1B on toy-sums; sized for 1 node x 1 GPUs (80 GB)"
        in out
    )
    assert "toy-sums" in out and "owner/toy-sums: sums" in out
    assert set(recipes()) == {"toy-grpo", "orphan-grpo"} and recipe_of("toy-grpo").package == "(in-process)"


def test_a_recipe_no_installed_plugin_registers_names_the_packages(
    toy_recipes, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--recipe", "avqa-omni-grpo"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'avqa-omni-grpo'; installed: " in err and "toy-grpo ((in-process))" in err
    assert "relax-rewards (the text math recipes and datasets)" in err and "relax-omni" in err
    assert not (tmp_path / "avqa-omni-grpo.yaml").exists()
    assert main(["data", "prepare", "dapo-math-17k", "--smoke"]) == 2
    assert "unknown recipe or dataset 'dapo-math-17k'" in capsys.readouterr().err
    with pytest.raises(
        KeyError, match="trains on dataset 'not-installed', which no installed plugin registers"
    ):
        dataset_of("orphan-grpo")


def test_init_writes_a_registered_recipe_and_says_what_comes_next(toy_recipes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--recipe", "toy-grpo", "--mode", "hybrid"]) == 0
    out = capsys.readouterr().out
    assert (
        "relax data prepare toy-sums --source owner/toy-sums" in out and "relax run examples/none.yaml" in out
    )
    cfg = load_config(tmp_path / "toy-grpo.yaml")
    assert cfg.mode == "hybrid" and cfg.rollout.temperature == 0.5  # the recipe's mode_fields
    assert main(["init", "--recipe", "toy-grpo", "--mode", "colocate", "--force"]) == 2
    assert "recipe 'toy-grpo' is written for mode async or hybrid" in capsys.readouterr().err
    assert (
        main(["init", "--recipe", "orphan-grpo", "--out", "o.yaml"]) == 0
    )  # written; its data cannot be made yet
    assert "cannot prepare its data yet: recipe 'orphan-grpo' (" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"hub_id": None},
            "missing 1 required keyword-only argument: 'hub_id'|missing 1 required positional",
        ),
        ({"colour": "red"}, "unexpected keyword argument 'colour'"),
        ({"reward": ""}, "reward must be non-empty texts"),
    ],
)
def test_a_malformed_registration_names_its_plugin(monkeypatch, fields, message):
    install(monkeypatch, toy_plugin(**fields))
    with pytest.raises(PluginError, match=f"plugin 'toy': dataset 'toy-sums': .*({message})"):
        datasets()


def test_smoke_inputs_and_model_shape_come_from_the_registration(toy_recipes, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    reg = toy_recipes.registration("inputs", "toy-sums-smoke")
    assert (
        reg.options["fills"] == ("model.path", "data.path", "eval.sets.heldout.path") and reg.plugin == "toy"
    )
    made = reg.factory(SmokeInputsParams(rows=3), None)
    assert made["model.path"].endswith("models/toy-model")
    train = [json.loads(x)["label"] for x in open(made["data.path"])]
    held = [json.loads(x)["label"] for x in open(made["eval.sets.heldout.path"])]
    assert len(train) == 3 and len(held) == 2  # 3 rows and 2 carved out for the eval set (the toy's heldout)
    assert sorted(train + held) == ["0", "2", "4", "6", "8"]  # the two malformed fixture rows skipped
    assert bundled_config("Toy-1B") == {"hidden_size": 64} and bundled_config("Other-1B") is None
