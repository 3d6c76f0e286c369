"""Per-GPU memory plan of a run, from the models' ``config.json`` and the backends' layouts (no weights
loaded): ``relax plan`` prints it, ``relax validate`` / ``relax run`` refuse a run whose plan cannot fit
``cluster.gpu_memory_gb`` (docs/memory-plan.md: the terms, their assumptions and how they were checked)."""

from relax.core.memory_plan.layout import (
    DeclaresLayout,
    EngineLayout,
    TrainLayout,
    model_parallel,
    replicated,
    sharded,
)
from relax.core.memory_plan.plan import Device, MemoryPlan, build_plan
from relax.core.memory_plan.report import format_plan
from relax.core.memory_plan.shape import ModelShape, ShapeError, shape_from_config
from relax.core.memory_plan.source import gpu_memory, plan_errors, plan_for

__all__ = [
    "DeclaresLayout",
    "Device",
    "EngineLayout",
    "MemoryPlan",
    "ModelShape",
    "ShapeError",
    "TrainLayout",
    "build_plan",
    "format_plan",
    "gpu_memory",
    "model_parallel",
    "plan_errors",
    "plan_for",
    "replicated",
    "shape_from_config",
    "sharded",
]
