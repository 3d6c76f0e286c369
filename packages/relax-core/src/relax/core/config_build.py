"""Mappings -> typed dataclasses, and ``key.path=value`` overrides -> mappings: the generic half of
:mod:`relax.core.config`, which knows no config section. Problems are collected into ``errors`` (one message
per field, naming its path) so that a config reports all of them at once."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal

import yaml

from relax.core.errors import ConfigError

_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check/convert one value against a type hint; append a message to ``errors`` on mismatch."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}")
            return None
        return build_dataclass(tp, value, path, errors)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            errors.append(
                f"{path}: {value!r} is not allowed; allowed values: {', '.join(map(repr, allowed))}"
            )
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(value, non_none[0], path, errors)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            errors.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return None
        return [_convert(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return None
        item_tp = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        if dataclasses.is_dataclass(item_tp):  # named sections (eval.sets.<name>): each one typed
            return {k: _convert(v, item_tp, f"{path}.{k}", errors) for k, v in value.items()}
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        return float(value)  # YAML 1.1 reads "1e-5" (no dot) as a string
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        errors.append(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return None
    return value


def build_dataclass(cls: type, data: dict[str, Any], prefix: str, errors: list[str]) -> Any:
    """``cls(**data)`` with every field checked against its type hint; ``None`` when ``errors`` got any."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in hints:
            errors.append(f"{path}: unknown key; allowed keys: {', '.join(names)}")
            continue
        kwargs[key] = _convert(value, hints[key], path, errors)
    if errors:
        return None
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "rollout.stop=[a, b]"]`` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, mappings merged key by key (the overrides over the YAML file)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out
