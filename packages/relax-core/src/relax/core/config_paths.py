"""The rule for relative paths in a config file: they resolve against the current directory -- the one
``relax`` runs from -- as any path given to a command-line tool does, never against the config file's own
directory (so ``run_dir: runs/x`` lands where you are, and one config serves every checkout it is copied to).

A path missing from the current directory that exists relative to the config file's directory, or one of
its parents, is nearly always a config run from somewhere else (``relax run ~/relax/examples/x.yaml`` from
``~``): its error then says where the file is and the two ways to fix it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from relax.core.errors import ConfigError

_HEADER = "invalid config:"
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]-]*): ")


def _value(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def found_elsewhere(value: str, config_file: Path) -> Path | None:
    """The directory (the config file's, or the nearest parent of it) that ``value`` exists relative to,
    when it does not exist relative to the current directory; None otherwise."""
    if os.path.isabs(value) or Path(value).exists():
        return None
    start = config_file.resolve().parent
    return next((d for d in (start, *start.parents) if (d / value).exists()), None)


def hint(field: str, value: str, config_file: Path) -> str | None:
    """What to do about ``field``'s missing relative path ``value``, or None when there is nothing to say."""
    where = found_elsewhere(value, config_file)
    if where is None:
        return None
    whose = (
        "the config file's directory"
        if where == config_file.resolve().parent
        else "a parent of the config file"
    )
    absolute = where / value
    return (
        f"relative paths resolve against the current directory ({Path.cwd()}), but {value!r} exists "
        f"relative to {where} ({whose}): run relax from {where}, or write the absolute path in the config "
        f"(or override {field}={absolute})"
    )


def with_path_hints(error: ConfigError, data: dict[str, Any], config_file: Path) -> ConfigError:
    """``error`` with a hint on each line whose field holds a relative path that exists elsewhere."""
    lines = str(error).split("\n  ")
    if lines[0] != _HEADER:
        return error
    changed = False
    for i, line in enumerate(lines[1:], start=1):
        m = _FIELD.match(line)
        value = _value(data, m.group(1)) if m else None
        if isinstance(value, str) and (why := hint(m.group(1), value, config_file)):
            lines[i], changed = f"{line} -- {why}", True
    return ConfigError("\n  ".join(lines)) if changed else error
