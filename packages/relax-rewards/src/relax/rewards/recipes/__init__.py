"""The text math recipes, with the reward they train on (``math``): GRPO and PPO on Qwen3-4B over DAPO-Math-17k
(``relax init --recipe dapo-math-grpo | dapo-math-ppo``), the dataset's converter (``relax data prepare
dapo-math-17k``) and its CPU smoke inputs (``dapo-math-17k-smoke``: core's quick-start model and fixture rows).
Registered by relax-rewards' plugin through core's recipe hooks; core names none of it (docs/recipes.md)."""

from __future__ import annotations

from typing import Any

from relax.core.recipes import GPU_COLOCATE, packaged, quickstart_model, register_smoke_inputs
from relax.rewards.recipes import dapo_math

HERE = __name__


def register_datasets(register: Any) -> None:
    register(
        dapo_math.NAME,
        dapo_math.convert,
        hub_id=dapo_math.HUB_ID,
        summary="17k competition math problems, answer on an 'Answer:' line",
        reward="math",
        write_fixture=dapo_math.write_fixture,
        heldout_rows=500,
    )


def register_recipes(register: Any) -> None:
    common = {
        "dataset": dapo_math.NAME,
        "model": "Qwen/Qwen3-4B",
        "mode_fields": {"colocate": GPU_COLOCATE},
        "model_config": packaged(HERE, "model_configs/Qwen3-4B.json"),
    }
    register(
        "dapo-math-grpo",
        packaged(HERE, "configs/dapo_math_grpo.yaml"),
        hardware="1 node x 8 GPUs (80 GB)",
        example="examples/qwen3_4b_grpo_math.yaml",
        smoke="examples/recipes/dapo_math_grpo_smoke.yaml",
        **common,
    )
    register(
        "dapo-math-ppo",
        packaged(HERE, "configs/dapo_math_ppo.yaml"),
        hardware="1 node x 8 GPUs (141 GB, H200)",
        example="examples/recipes/qwen3_4b_ppo_math.yaml",
        smoke="examples/recipes/dapo_math_ppo_smoke.yaml",
        **common,
    )


def register_inputs(register: Any) -> None:
    register_smoke_inputs(register, dapo_math.NAME, quickstart_model)
