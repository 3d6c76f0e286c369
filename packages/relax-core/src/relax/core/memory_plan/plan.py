"""The memory plan of a run: each kind of GPU it uses, what is on it, and whether it fits.

``build_plan`` is pure (config, shapes, GPU size in); ``relax.core.memory_plan.source`` reads the shapes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from relax.core.memory_plan import roles
from relax.core.memory_plan.builtin_layouts import engine_layout, recompute, trainer_layout
from relax.core.memory_plan.layout import EngineLayout, TrainLayout
from relax.core.memory_plan.shape import ModelShape
from relax.core.memory_plan.terms import GIB

HEADROOM = 0.05  # of each GPU kept free: allocator fragmentation and what the terms leave out


@dataclass(frozen=True)
class Device:
    """A kind of GPU of the run (``count`` of them) at its peak, and what holds memory on it."""

    name: str
    count: int
    terms: dict[str, float]
    reserved: bool = True  # False: the role asks Ray for no GPU (reference / teacher actors)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass(frozen=True)
class MemoryPlan:
    gpu_gib: float
    devices: list[Device]
    gpus: int  # GPUs the run reserves
    stated_gpus: int = 0  # cluster.gpus (0: not stated)
    notes: list[str] = field(default_factory=list)
    kv_tokens: float | None = None  # what one server's KV cache holds (None: no engine on a GPU)
    row: int = 0  # the longest row: prompt + response

    @property
    def usable(self) -> float:
        return self.gpu_gib * GIB * (1 - HEADROOM)

    def errors(self) -> list[str]:
        """Why the plan cannot run: a GPU over its usable memory (naming the largest term), or more GPUs
        than stated."""
        out = []
        for d in self.devices:
            if d.total > self.usable:
                term, size = max(d.terms.items(), key=lambda kv: kv[1])
                out.append(
                    f"memory plan: {d.name} needs {d.total / GIB:.1f} GiB > {self.usable / GIB:.1f} GiB usable "
                    f"of {self.gpu_gib:g} GiB (largest term: {term} {size / GIB:.1f} GiB; `relax plan` prints "
                    "every term)"
                )
        if self.kv_tokens is not None and self.kv_tokens < self.row:
            out.append(
                f"memory plan: an engine's KV cache holds {self.kv_tokens:.0f} tokens, less than one row of "
                f"{self.row} (data.max_prompt_length + the response): raise its memory fraction, or its "
                "tensor parallelism"
            )
        if self.stated_gpus and self.gpus > self.stated_gpus:
            out.append(
                f"memory plan: the run reserves {self.gpus} GPUs, cluster.gpus states {self.stated_gpus}"
            )
        return out


def _gpus(layout: TrainLayout | EngineLayout | None) -> int:
    if isinstance(layout, TrainLayout):
        return layout.world
    return layout.gpus if isinstance(layout, EngineLayout) else 0


def build_plan(
    cfg: Any,
    shape: ModelShape,
    gpu_gib: float,
    *,
    critic: ModelShape | None = None,
    reference: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> MemoryPlan:
    """Every GPU kind of ``cfg``: trainer ranks and engines on their own GPUs (async / hybrid) or one shared
    GPU per rank seen at both peaks (colocate); reference / teacher as one GPU each. ``critic`` etc.: the
    shapes of those roles' models when the run has them."""
    size = dataclasses.replace(roles.sizes(cfg), recompute=recompute(cfg))
    notes: list[str] = []
    tl, el = trainer_layout(cfg), engine_layout(cfg, size.row)
    for what, layout in (("trainer", tl), ("rollout engine", el)):
        if isinstance(layout, str):
            notes.append(f"{what}: {layout}")
    tl = tl if isinstance(tl, TrainLayout) else None
    el = el if isinstance(el, EngineLayout) else None
    dtype = _train_dtype(cfg)
    devices: list[Device] = []
    train = roles.trainer_terms(shape, tl, cfg, size, dtype, critic) if tl else None
    engine = roles.engine_terms(shape, el, gpu_gib * GIB) if el else None
    engines = cfg.rollout.num_engines
    if cfg.mode == "colocate" and train and engine:
        offload = bool(getattr(cfg.trainer, "offload", False))
        devices.append(Device("colocated GPU while training", tl.world, {**train, **engine.idle}))
        devices.append(
            Device(
                "colocated GPU while generating",
                tl.world,
                {**roles.resident_terms(train, offload), **engine.terms},
            )
        )
        gpus = max(tl.world, engines * el.gpus)
    else:
        if train:
            devices.append(Device(f"trainer GPU ({_describe(tl)})", tl.world, train))
        if engine:
            devices.append(Device(f"engine GPU (tp {el.tensor_parallel})", engines * el.gpus, engine.terms))
        gpus = _gpus(tl) + engines * _gpus(el)
    on_gpu = tl is not None
    for name, model in (("reference", reference), ("teacher", teacher)):
        if model is not None and on_gpu:
            devices.append(
                Device(f"{name} GPU (frozen, {dtype})", 1, roles.frozen_terms(model, dtype, size), False)
            )
    if engine:
        notes.append(
            f"engine KV cache: {engine.kv_tokens:,.0f} tokens per server "
            f"({engine.kv_tokens / size.row:.1f} rows of {size.row})"
        )
    stated = int(getattr(getattr(cfg, "cluster", None), "gpus", 0) or 0)
    return MemoryPlan(gpu_gib, devices, gpus, stated, notes, engine.kv_tokens if engine else None, size.row)


def _train_dtype(cfg: Any) -> str:
    params = cfg.trainer.backend_params
    return getattr(params, "dtype", None) or cfg.model.dtype


def _describe(layout: TrainLayout) -> str:
    parts = [f"{layout.world} ranks"]
    if layout.note:
        parts.append(layout.note)
    return ", ".join(parts)
