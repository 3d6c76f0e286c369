"""Checks of the ``eval`` config section (its dataclasses live in ``relax.core.config``), each message
naming its field, so ``relax validate`` names a bad eval set before anything starts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a set's name is a directory and a metric prefix
SUFFIXES = (".jsonl", ".json", ".parquet")


def eval_errors(cfg: Any) -> list[str]:
    """Problems in ``eval`` (and ``logging.log_samples``) knowable without plugins or files."""
    ev, errors = cfg.eval, []
    if cfg.data.task_heldout < 0:
        errors.append(f"data.task_heldout: must be >= 0, got {cfg.data.task_heldout}")
    if ev.every_n_steps < 0:
        errors.append(
            f"eval.every_n_steps: must be >= 0 (0: only before_train / at_end), got {ev.every_n_steps}"
        )
    if ev.sets and not (ev.every_n_steps or ev.before_train or ev.at_end):
        errors.append(
            "eval: sets are configured but never evaluated; set every_n_steps, before_train or at_end"
        )
    for name, s in ev.sets.items():
        where = f"eval.sets.{name}"
        if not _NAME.match(name):
            errors.append(
                f"{where}: a set's name may hold letters, digits, '_', '-' and '.' only (it names a directory)"
            )
        if s.n_samples < 1:
            errors.append(f"{where}.n_samples: must be >= 1, got {s.n_samples}")
        if s.temperature < 0:
            errors.append(f"{where}.temperature: must be >= 0 (0 = greedy), got {s.temperature}")
        if not 0 < s.top_p <= 1:
            errors.append(f"{where}.top_p: must be in (0, 1], got {s.top_p}")
        if s.max_new_tokens is not None and s.max_new_tokens < 1:
            errors.append(f"{where}.max_new_tokens: must be >= 1 or null, got {s.max_new_tokens}")
        if s.max_prompts is not None and s.max_prompts < 1:
            errors.append(f"{where}.max_prompts: must be >= 1 or null, got {s.max_prompts}")
        if s.temperature == 0 and s.n_samples > 1:
            errors.append(
                f"{where}.n_samples: {s.n_samples} greedy responses are one response {s.n_samples} times; "
                "set temperature > 0 for pass@k"
            )
        if s.path is None:
            if cfg.inputs.name is not None and cfg.data.path is None:
                pass  # built on first use with the data (a recipe's smoke variant): checked once filled
            elif cfg.data.path is not None or cfg.data.task_heldout <= 0:
                errors.append(
                    f"{where}.path: null means the quick-start task's held-out split, which needs "
                    "data.path: null and data.task_heldout > 0; name a .jsonl/.parquet file"
                )
        elif Path(s.path).suffix not in SUFFIXES and not Path(s.path).is_dir():
            errors.append(
                f"{where}.path: {s.path!r} must be a .jsonl, .json or .parquet file or a dataset directory"
            )
        if s.reward is not None and s.reward.timeout_s <= 0:
            errors.append(f"{where}.reward.timeout_s: must be > 0, got {s.reward.timeout_s}")
    return errors


def eval_plugin_errors(cfg: Any, manager: Any, build_section: Any) -> list[str]:
    """Unknown reward / environment names and bad typed params of every eval set (``manager``: the plugin
    manager; ``build_section``: the config loader's parser of a plugin's typed section)."""
    errors: list[str] = []
    for name, s in cfg.eval.sets.items():
        for sub, kind, selector, params in (
            ("reward", "reward", "name", "params"),
            ("environment", "environment", "name", "params"),
            ("environment", "tool_parser", "tool_parser", "tool_parser_params"),
        ):
            section = getattr(s, sub)
            if section is None or getattr(section, selector) is None:
                continue
            chosen, names = getattr(section, selector), manager.names(kind)
            where = f"eval.sets.{name}.{sub}"
            if chosen not in names:
                errors.append(
                    f"{where}.{selector}: unknown {kind} {chosen!r}; registered: {', '.join(names) or '(none)'}"
                )
                continue
            build_section(
                manager.registration(kind, chosen).config,
                getattr(section, params),
                f"{where}.{params}",
                errors,
            )
    return errors
