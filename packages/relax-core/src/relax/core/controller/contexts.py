"""Build each plugin's ``(params, ctx)`` from the run config: the one place that decides what a
plugin sees of the run (see ``relax.core.context``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from relax.core.config import PLUGIN_SECTIONS, RelaxConfig, build_section, config_error
from relax.core.context import PluginContext, Resources, TrainSpec
from relax.core.plugins import get_plugin_manager

_SECTION_OF_KIND = {kind: (section, selector, params) for section, selector, params, kind in PLUGIN_SECTIONS}


def plugin_params(cfg: RelaxConfig, kind: str) -> Any:
    """The selected plugin's typed section (parsed here when ``cfg`` was built without the loader)."""
    section, selector, field = _SECTION_OF_KIND[kind]
    sec = getattr(cfg, section)
    reg = get_plugin_manager().registration(kind, getattr(sec, selector))
    errors: list[str] = []
    typed = build_section(reg.config, getattr(sec, field), f"{section}.{field}", errors)
    if errors:
        raise config_error(errors)
    return typed


def build_plugin(cfg: RelaxConfig, kind: str, ctx: PluginContext) -> Any:
    """Instantiate the configured plugin of ``kind`` (call this inside the role's process)."""
    section, selector, _ = _SECTION_OF_KIND[kind]
    factory = get_plugin_manager().get(kind, getattr(getattr(cfg, section), selector))
    return factory(plugin_params(cfg, kind), ctx)


def resources_for(cfg: RelaxConfig, kind: str) -> Resources:
    """What one instance of the configured engine / trainer declares it needs."""
    section, selector, _ = _SECTION_OF_KIND[kind]
    reg = get_plugin_manager().registration(kind, getattr(getattr(cfg, section), selector))
    return reg.resources(plugin_params(cfg, kind)) if reg.resources else Resources()


def base_context(cfg: RelaxConfig, role: str, model_path: str | None, **fields: Any) -> PluginContext:
    ctx = PluginContext(
        role=role,
        run_dir=cfg.run_dir,
        seed=cfg.seed,
        model_path=model_path,
        tokenizer_path=model_path,
        dtype=cfg.model.dtype,
        timeout_s=cfg.weight_sync.timeout_s,
        bucket_bytes=cfg.weight_sync.bucket_mb << 20,
    )
    return replace(ctx, **fields)


def engine_context(cfg: RelaxConfig, model_path: str, index: int) -> PluginContext:
    return base_context(
        cfg,
        "rollout",
        model_path,
        index=index,
        world_size=cfg.rollout.num_engines,
        resources=resources_for(cfg, "rollout_engine"),
        record_routing=cfg.algorithm.routing_replay != "off",
        lora=cfg.trainer.lora,
    )


def trainer_context(cfg: RelaxConfig, model_path: str, role: str = "trainer", **fields: Any) -> PluginContext:
    """``role``: ``trainer`` (trainable policy), ``reference`` or ``teacher`` (frozen)."""
    spec = TrainSpec(
        optim=cfg.trainer,
        algorithm=cfg.algorithm,
        total_steps=cfg.total_steps,
        temperature=cfg.rollout.temperature,
        trainable=role == "trainer",
    )
    return base_context(cfg, role, model_path, train=spec, resources=resources_for(cfg, "trainer"), **fields)


class EngineHandle:
    """``ctx.engine_handle`` of a reward: ``handle()`` is a rollout engine actor (e.g. to ask a judge
    model with ``handle().generate.remote(requests)``), or None when the run has none. Picklable;
    ``RewardRole.set_engines`` refreshes ``engines`` after an engine is replaced."""

    def __init__(self, engines: list[Any] | None = None) -> None:
        self.engines = list(engines or [])

    def __call__(self) -> Any:
        return self.engines[0] if self.engines else None


def reward_context(
    cfg: RelaxConfig, model_path: str | None, engines: list[Any] | None = None
) -> PluginContext:
    """``engines``: the run's rollout engine handles, served to the reward by ``ctx.engine_handle()``."""
    return base_context(
        cfg,
        "reward",
        model_path,
        timeout_s=cfg.reward.timeout_s,
        engine_handle=EngineHandle(engines),
        fallback_score=cfg.reward.fallback_score,
    )


def processor_context(cfg: RelaxConfig, model_path: str) -> PluginContext:
    return base_context(cfg, "processor", model_path)
