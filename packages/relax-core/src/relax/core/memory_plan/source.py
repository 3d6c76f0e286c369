"""Where the plan's inputs come from: each role's model shape (its ``config.json``, else the shape a registered
recipe ships for a model of that name, so a recipe plans before its download) and the GPU size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax.core.memory_plan.plan import MemoryPlan, build_plan
from relax.core.memory_plan.shape import ModelShape, ShapeError, shape_from_config


def bundled_config(name: str) -> dict[str, Any] | None:
    """The config.json shape a registered recipe ships for its model, by the model directory's name (the last
    part of the recipe's Hub id)."""
    from relax.core.recipes import recipes

    for recipe in recipes().values():
        if recipe.model_config is not None and recipe.model.rsplit("/", 1)[-1] == name:
            return recipe.shape()
    return None


def model_config(path: str | None) -> tuple[dict[str, Any], str]:
    """(config.json, where it came from) of a model directory; None: the built-in quick-start model."""
    if path is None:
        from relax.core.quickstart_model import QUICKSTART_MODEL, build_tokenizer

        return {**QUICKSTART_MODEL, "vocab_size": len(build_tokenizer())}, "the quick-start model"
    file = Path(path) / "config.json"
    if file.is_file():
        try:
            return json.loads(file.read_text()), str(file)
        except (OSError, json.JSONDecodeError) as exc:
            raise ShapeError(f"{file}: not readable as JSON ({exc})") from None
    if (shipped := bundled_config(Path(path).name)) is not None:
        return shipped, f"the shape shipped for {Path(path).name} ({file} not there yet)"
    raise ShapeError(
        f"{file}: not found, and no shape is shipped for {Path(path).name!r}; download the model first"
    )


def shape_of(path: str | None) -> ModelShape:
    return shape_from_config(model_config(path)[0])


def gpu_memory(cfg: Any, override: float | None = None) -> float:
    """The GPU size the plan checks against: ``--gpu-memory``, else ``cluster.gpu_memory_gb`` (0: unknown)."""
    if override:
        return float(override)
    return float(getattr(getattr(cfg, "cluster", None), "gpu_memory_gb", 0) or 0)


def plan_for(cfg: Any, gpu_gib: float) -> MemoryPlan:
    """The run's plan: the policy's shape, and the critic's, reference's and teacher's when it has them."""
    from relax.core.algorithms import config_needs
    from relax.core.algorithms.config import POLICY_INIT

    policy = cfg.model.path
    critic = cfg.algorithm.critic
    needs = config_needs(cfg.algorithm)
    teacher = policy if cfg.algorithm.teacher_model_path == POLICY_INIT else cfg.algorithm.teacher_model_path
    return build_plan(
        cfg,
        shape_of(policy),
        gpu_gib,
        critic=shape_of(critic.model_path or policy) if critic.enable else None,
        reference=shape_of(policy) if "reference" in needs and cfg.trainer.lora is None else None,
        teacher=shape_of(teacher) if "teacher" in needs else None,
    )


def plan_errors(cfg: Any, override: float | None = None) -> list[str]:
    """``relax validate`` / ``relax run``: the plan's refusals when ``cluster.gpu_memory_gb`` is set."""
    gpu = gpu_memory(cfg, override)
    if not gpu:
        return []
    try:
        return plan_for(cfg, gpu).errors()
    except ShapeError as exc:
        return [f"memory plan: {exc}"]
