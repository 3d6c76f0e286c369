"""The media recipes, with the processors and model adapters they need: GRPO on Qwen3-VL-4B over
multimodal-open-r1-8k-verified (``openr1-vl-grpo``) and on Qwen3-Omni-30B-A3B over AVQA-R1-6K
(``avqa-omni-grpo``), their datasets' converters (``relax data prepare``) and CPU smoke inputs
(``<dataset>-smoke``: a tiny Qwen3-VL, or a whole tiny Qwen3-Omni as the recipe's model comes, and fixture rows).
Registered by relax-omni's plugin through core's recipe hooks; core names none of it (docs/recipes.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax.core.recipes import GPU_COLOCATE, packaged, register_smoke_inputs
from relax.omni.recipes import avqa, openr1_vl

HERE = __name__


def tiny_vl(models: Path) -> str:
    """The smoke model of the VL recipe: a tiny Qwen3-VL built locally from a config."""
    from relax.omni import tiny_models as mm

    return mm.tiny_multimodal_dir(models, "qwen3_vl")


def tiny_whole_omni(models: Path) -> str:
    """The smoke model of the Omni recipe: a tiny Qwen3-Omni thinker wrapped as the whole checkpoint (the
    recipe trains the thinker of the whole model as released; so does its smoke variant)."""
    from relax.omni import tiny_models as mm

    return mm.tiny_whole_omni_dir(models, "qwen3_omni")


def register_datasets(register: Any) -> None:
    register(
        openr1_vl.NAME,
        openr1_vl.convert,
        hub_id=openr1_vl.HUB_ID,
        summary="7.7k image + math question pairs, <answer> solutions",
        reward="openr1_mm",
        write_fixture=openr1_vl.write_fixture,
        heldout_rows=200,
    )
    register(
        avqa.NAME,
        avqa.convert,
        hub_id=avqa.HUB_ID,
        summary="6.4k image + audio multiple-choice questions (4 options)",
        reward="multiple_choice",
        write_fixture=avqa.write_fixture,
        read=avqa.read,
        heldout_split="valid",
    )


def register_recipes(register: Any) -> None:
    register(
        "openr1-vl-grpo",
        packaged(HERE, "configs/openr1_vl_grpo.yaml"),
        dataset=openr1_vl.NAME,
        model="Qwen/Qwen3-VL-4B-Instruct",
        hardware="1 node x 8 GPUs (80 GB)",
        example="examples/omni/qwen3_vl_4b_grpo.yaml",
        smoke="examples/recipes/openr1_vl_grpo_smoke.yaml",
        mode_fields={"colocate": GPU_COLOCATE},
        model_config=packaged(HERE, "model_configs/Qwen3-VL-4B-Instruct.json"),
    )
    register(
        "avqa-omni-grpo",
        packaged(HERE, "configs/avqa_omni_grpo.yaml"),
        dataset=avqa.NAME,
        model="Qwen/Qwen3-Omni-30B-A3B-Instruct",
        hardware="2 nodes x 8 GPUs (80 GB)",
        example="examples/omni/qwen3_omni_30b_a3b_grpo.yaml",
        smoke="examples/recipes/avqa_omni_grpo_smoke.yaml",
        modes=("async", "hybrid"),
        model_config=packaged(HERE, "model_configs/Qwen3-Omni-30B-A3B-Instruct.json"),
    )


def register_inputs(register: Any) -> None:
    register_smoke_inputs(register, openr1_vl.NAME, tiny_vl, media=True)
    register_smoke_inputs(register, avqa.NAME, tiny_whole_omni, media=True)
