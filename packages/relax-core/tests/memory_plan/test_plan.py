"""The memory plan of configs: every seed recipe fits the GPUs it states, a plan that cannot fit is refused
naming the term that overflows (``relax plan``, ``relax validate``), and shapes are read from config.json alone."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from relax.core.cli import main
from relax.core.config import load_config
from relax.core.memory_plan import plan_for, shape_from_config
from relax.core.memory_plan.source import bundled_config
from relax.core.recipes import recipes
from relax.core.recipes.starter import starter_text, validate_text

REPO = Path(__file__).resolve().parents[4]
RECIPES = recipes()  # the installed plugins' (relax-rewards' and relax-omni's in this workspace)
CASES = [(name, mode) for name, recipe in RECIPES.items() for mode in (None, *recipe.modes)]


def stated(hardware: str) -> tuple[int, float]:
    """``"2 nodes x 8 GPUs (80 GB)"`` -> (16, 80.0): the catalog's words for what the recipe is sized for."""
    nodes, per_node, memory = re.match(r"(\d+) nodes? x (\d+) GPUs \((\d+) GB", hardware).groups()
    return int(nodes) * int(per_node), float(memory)


@pytest.mark.parametrize(("recipe", "mode"), CASES, ids=[f"{r}-{m or 'default'}" for r, m in CASES])
def test_every_recipe_fits_its_stated_gpus(recipe, mode):
    """What ``relax init --recipe R [--mode M]`` writes validates with its plan fitting the hardware the catalog
    states for it (its ``cluster`` section says the same), from the model shapes the recipes ship."""
    cfg = validate_text(starter_text(recipe, mode))
    assert (cfg.cluster.gpus, cfg.cluster.gpu_memory_gb) == stated(RECIPES[recipe].hardware)
    plan = plan_for(cfg, cfg.cluster.gpu_memory_gb)
    assert not plan.errors(), plan.errors()
    assert 0 < plan.gpus <= cfg.cluster.gpus and plan.devices
    assert all(d.total > 0 for d in plan.devices)


def test_a_plan_over_the_gpu_names_the_term_that_overflows():
    path = REPO / RECIPES["dapo-math-grpo"].example
    cfg = load_config(path, ["trainer.recompute='off'", "trainer.max_tokens_per_micro_batch=0"])
    (error,) = plan_for(cfg, 80).errors()
    assert error.startswith("memory plan: trainer GPU") and "largest term: activations" in error
    cfg = load_config(path, ["rollout.engine_params.mem_fraction_static=0.1"])  # 8 GiB: 7.5 weights, 0.5 KV
    assert plan_for(cfg, 80).errors() == [
        "memory plan: an engine's KV cache holds 3696 tokens, less than one row of 9216 (data.max_prompt_length + "
        "the response): raise its memory fraction, or its tensor parallelism"
    ]
    cfg = load_config(path, ["cluster.gpus=4"])
    assert plan_for(cfg, 80).errors() == ["memory plan: the run reserves 8 GPUs, cluster.gpus states 4"]


def test_recompute_and_token_budget_shrink_activations():
    path = REPO / RECIPES["dapo-math-grpo"].example
    peak = {
        over: max(
            d.total
            for d in plan_for(load_config(path, list(over)), 80).devices
            if d.name.startswith("trainer")
        )
        for over in [
            ("trainer.recompute='off'",),
            ("trainer.recompute=full",),
            ("trainer.recompute=full", "trainer.max_tokens_per_micro_batch=9216"),
        ]
    }
    off, full, small = peak.values()
    assert off > full > small


def test_relax_plan_prints_every_gpu_and_exits_2_when_it_does_not_fit(capsys):
    example = str(REPO / RECIPES["dapo-math-grpo"].example)
    assert main(["plan", example]) == 0
    out = capsys.readouterr().out
    assert (
        "trainer GPU" in out and "engine GPU" in out and "policy optimizer (AdamW)" in out and "fits" in out
    )
    assert "8 GPUs reserved of 8 stated" in out
    assert main(["plan", example, "--gpu-memory", "40"]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "> 38.0 GiB usable of 40 GiB" in out
    assert main(["plan", example, "cluster.gpu_memory_gb=0"]) == 2
    assert "pass --gpu-memory" in capsys.readouterr().err


def test_relax_validate_refuses_a_plan_that_does_not_fit(tmp_path, capsys):
    """The quick-start on a (pretend) CUDA device: nothing runs, the plan is read from the config alone."""
    over = ["trainer.backend_params.device=cuda", f"run_dir={tmp_path / 'run'}"]
    assert main(["validate", *over, "cluster.gpu_memory_gb=1"]) == 2
    err = capsys.readouterr().err
    assert "memory plan: trainer GPU" in err and "largest term: CUDA runtime 1.5 GiB" in err
    assert main(["validate", *over, "--gpu-memory", "80"]) == 0
    assert "trainer GPU (1 ranks, torch DP 1, float32) x1" in capsys.readouterr().out
    assert main(["validate", f"run_dir={tmp_path / 'run'}"]) == 0  # on CPU: no GPU term, no table
    assert "memory plan" not in capsys.readouterr().out


def test_nested_configs_plan_the_trained_model_only():
    """A media model's LM is its text config with its towers; a speech generator beside it is not trained."""
    omni = shape_from_config(bundled_config("Qwen3-Omni-30B-A3B-Instruct"))
    assert (omni.hidden, omni.layers, omni.experts, omni.moe_layers, omni.tied_embeddings) == (
        2048,
        48,
        128,
        48,
        False,
    )
    assert 30.5e9 < omni.total_params() < 32e9 and 0.9e9 < omni.tower_params < 1.5e9
    vl = shape_from_config(bundled_config("Qwen3-VL-4B-Instruct"))
    assert abs(vl.total_params() / 4.44e9 - 1) < 0.01  # the published parameter count
    assert shape_from_config(bundled_config("Qwen3-4B")).total_params() == 4_022_468_096


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_omni", "qwen2_5_vl"])
def test_media_model_parameters_from_config_within_10_percent(family, tmp_path):
    """Towers are estimated (encoder blocks, patch / position embeddings, mergers): against a real checkpoint."""
    from safetensors import safe_open

    from relax.omni.tiny_models import tiny_multimodal_dir

    model = Path(tiny_multimodal_dir(tmp_path, family))
    real = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as tensors:
            real += sum(math.prod(tensors.get_slice(k).get_shape()) for k in tensors.keys())
    estimate = shape_from_config(json.loads((model / "config.json").read_text())).total_params()
    assert abs(estimate / real - 1) < 0.10, (estimate, real)


def test_the_docs_recipe_table_is_the_generated_one():
    """docs/gpu.md's per-recipe table is exactly what the plan code prints (regenerate with
    ``python -m relax.core.memory_plan.recipe_table`` and paste it between the markers)."""
    from relax.core.memory_plan.recipe_table import BEGIN, END, markdown

    page = (REPO / "docs" / "gpu.md").read_text()
    assert BEGIN in page and END in page
    written = page[page.index(BEGIN) : page.index(END) + len(END)]
    assert written == markdown(), "docs/gpu.md's recipe table drifted from the memory plan: regenerate it"


def test_backend_layouts_split_what_they_split():
    """relax-megatron's and relax-sglang's ``memory_layout``: the distributed optimizer halves masters and
    moments over DP 2 (not the grad buffer); SGLang at tp 2 holds half the weights on twice the GPUs."""
    path = REPO / RECIPES["dapo-math-grpo"].example

    def trainer_terms(*over: str) -> dict[str, float]:
        plan = plan_for(load_config(path, list(over)), 80)
        return next(d.terms for d in plan.devices if d.name.startswith("trainer"))

    plain, sharded = trainer_terms(), trainer_terms("trainer.backend_params.distributed_optimizer=true")
    for term, ratio in (("policy fp32 masters", 2), ("policy optimizer (AdamW)", 2), ("policy gradients", 1)):
        assert plain[term] == pytest.approx(ratio * sharded[term]), term
    one, two = (
        plan_for(load_config(path, [f"rollout.engine_params.tp_size={tp}", "cluster.gpus=12"]), 80)
        for tp in (1, 2)
    )
    assert (one.gpus, two.gpus) == (8, 12)
    weights = [
        next(d.terms["engine weights"] for d in p.devices if d.name.startswith("engine")) for p in (one, two)
    ]
    assert weights[0] == pytest.approx(2 * weights[1])


def test_every_example_on_gpus_states_them_and_fits():
    """Any example config that puts a trainer or engine on CUDA says which GPUs it is written for and is a
    recipe's (whose plan is checked above): a new GPU example cannot skip the plan."""
    import yaml

    on_gpu = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        devices = [
            str(((data.get(s) or {}).get(p) or {}).get("device", ""))
            for s, p in (("trainer", "backend_params"), ("rollout", "engine_params"))
        ]
        if any(d.startswith("cuda") for d in devices):
            on_gpu.append(path.relative_to(REPO).as_posix())
            cluster = data.get("cluster") or {}
            assert cluster.get("gpus") and cluster.get("gpu_memory_gb"), f"{path}: no cluster section"
    # each is a recipe's example, the text relax init writes, whose plan the test above fits in every mode
    assert sorted(on_gpu) == sorted(r.example for r in RECIPES.values()), on_gpu
