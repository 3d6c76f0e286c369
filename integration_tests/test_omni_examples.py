"""The omni examples: the two CPU quick-starts and the GPU-scale Qwen3-VL-4B / Qwen3-Omni-30B-A3B recipes load
and validate (their model/data paths pointed at tiny local stand-ins). The audio quick-start's GRPO run through
Ray is in test_omni_path.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.testing.multimodal_models import tiny_multimodal_dir

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES = {  # file -> the family its processor needs (quick-starts: built by examples/omni/prepare.py)
    "quickstart_omni_vl.yaml": "qwen2_5_vl",
    "quickstart_omni_audio.yaml": "qwen2_5_omni",
    "omni/qwen3_vl_4b_grpo.yaml": "qwen3_vl",
    "omni/qwen3_omni_30b_a3b_grpo.yaml": "qwen3_omni",
}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("omni_prepare", EXAMPLES / "omni" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    from relax.omni.synthetic import make_dataset

    root = tmp_path_factory.mktemp("omni_examples")
    return {name: make_dataset(root / name, kinds, rows=8) for name, (_, kinds) in prepare.TASKS.items()}


def paths(tmp_path_factory, task, recipe):
    family = RECIPES[recipe]
    data = task["audio" if "omni" in family else "vl"]
    model = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), family)
    return [f"model.path={model}", f"data.path={data}", f"data.processor_params.media_root={data.parent}"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_validates(tmp_path_factory, task, recipe):
    cfg = load_config(str(EXAMPLES / recipe), paths(tmp_path_factory, task, recipe))
    assert cfg.data.processor == RECIPES[recipe]
    assert type(cfg.data.processor_params).__name__ == "OmniProcessorParams"
    assert cfg.data.processor_params.max_pixels >= cfg.data.processor_params.min_pixels
