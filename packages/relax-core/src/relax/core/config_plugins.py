"""The plugin sections of a config: each selected plugin's own params parsed into its registered dataclass,
checked by it (``validate``, ``validate_run``), and the names a config selects checked against the registry."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from relax.core.config_build import build_dataclass

if TYPE_CHECKING:
    from relax.core.config import RelaxConfig


#: (section, selector field, params field, registry kind): where each plugin's own config lives
PLUGIN_SECTIONS = (
    ("rollout", "engine", "engine_params", "rollout_engine"),
    ("trainer", "backend", "backend_params", "trainer"),
    ("reward", "name", "params", "reward"),
    ("weight_sync", "transport", "params", "weight_sync"),
    ("data", "processor", "processor_params", "processor"),
    ("environment", "name", "params", "environment"),
    ("environment", "tool_parser", "tool_parser_params", "tool_parser"),
    ("inputs", "name", "params", "inputs"),
)


def build_section(config_cls: type | None, value: Any, path: str, errors: list[str]) -> Any:
    """Parse one plugin section (a mapping) into the plugin's registered dataclass; a dataclass may
    add cross-field checks with ``validate(self) -> list[str]`` (messages name fields relative to it)."""
    if config_cls is None or isinstance(value, config_cls):
        return value
    if not isinstance(value, dict):
        errors.append(
            f"{path}: expected a mapping of {config_cls.__name__} fields, got {type(value).__name__}"
        )
        return value
    local: list[str] = []
    typed = build_dataclass(config_cls, value, path, local)
    if typed is not None and hasattr(typed, "validate"):
        local += [f"{path}.{msg}" for msg in typed.validate()]
    errors.extend(local)
    return typed if typed is not None else value


def typed_plugin_sections(cfg: RelaxConfig, errors: list[str]) -> RelaxConfig:
    """Replace each selected plugin's dict section by its registered config dataclass."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for section, selector, params_field, kind in PLUGIN_SECTIONS:
        sec = getattr(cfg, section)
        if getattr(sec, selector) is None:  # an optional section left off (environment.name: null)
            continue
        reg = manager.registration(kind, getattr(sec, selector))
        typed = build_section(reg.config, getattr(sec, params_field), f"{section}.{params_field}", errors)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sec, **{params_field: typed})})
    return cfg


def plugin_run_errors(cfg: RelaxConfig) -> list[str]:
    """A plugin's typed section may check itself against the whole run (e.g. a dtype it inherits
    from ``model.dtype``): ``validate_run(self, cfg) -> list[str]``, messages naming full field paths."""
    errors: list[str] = []
    for section, _, params_field, _ in PLUGIN_SECTIONS:
        check = getattr(getattr(getattr(cfg, section), params_field), "validate_run", None)
        if callable(check):
            errors.extend(check(cfg))
    return errors


def derived_reward_timeout(cfg: RelaxConfig, data: dict[str, Any]) -> RelaxConfig:
    """``reward.timeout_s`` left out of the config: a reward's typed params may derive it from their
    own per-call limits (``params.group_timeout_s(group_size)``: the hub's from ``call_timeout_s``)."""
    derive = getattr(cfg.reward.params, "group_timeout_s", None)
    if "timeout_s" in (data.get("reward") or {}) or not callable(derive):
        return cfg
    timeout_s = float(derive(cfg.rollout.n_samples_per_prompt))
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, timeout_s=timeout_s))


def plugin_errors(cfg: RelaxConfig) -> list[str]:
    """Every plugin name the config selects is registered; an environment answered with tool calls has a
    tool parser."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    checks = [
        ("rollout.engine", "rollout_engine", cfg.rollout.engine),
        ("trainer.backend", "trainer", cfg.trainer.backend),
        ("reward.name", "reward", cfg.reward.name),
        ("weight_sync.transport", "weight_sync", cfg.weight_sync.transport),
        ("data.processor", "processor", cfg.data.processor),
        ("queue.name", "queue", cfg.queue.name),
        ("algorithm.advantage_estimator", "advantage", cfg.algorithm.advantage_estimator),
        ("algorithm.policy_loss", "policy_loss", cfg.algorithm.policy_loss),
        ("algorithm.kl.estimator", "kl", cfg.algorithm.kl.estimator),
        ("environment.name", "environment", cfg.environment.name),
        ("environment.tool_parser", "tool_parser", cfg.environment.tool_parser),
        ("inputs.name", "inputs", cfg.inputs.name),
    ]
    errors = []
    for path, kind, name in checks:
        if name is None:
            continue
        names = manager.names(kind)
        if name not in names:
            errors.append(f"{path}: unknown {kind} {name!r}; registered: {', '.join(names) or '(none)'}")
    env = cfg.environment
    if (
        env.tool_parser == "none"
        and env.name in manager.names("environment")
        and manager.registration("environment", env.name).options.get("tool_calls")
    ):
        parsers = [n for n in manager.names("tool_parser") if n != "none"]
        errors.append(
            f"environment.tool_parser: 'none' finds no tool call, but environment {env.name!r} is answered with "
            f"tool calls (registered with tool_calls=True); set one of: {', '.join(parsers) or '(none installed)'}"
        )
    return errors
