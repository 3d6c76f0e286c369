"""Change one field of a commented YAML config in place, keeping every other line (and the comments that
make a starter config worth reading) as written. Enough YAML for Relax configs: block mappings indented by
spaces, one ``key: value`` per line; a field that is absent is added at the end of its section."""

from __future__ import annotations

from typing import Any

import yaml


def render(value: Any) -> str:
    """``value`` as one YAML flow scalar / collection (``true``, ``0``, ``{}``, ``[a, b]``, ``{backend: nccl}``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _block_end(lines: list[str], at: int) -> int:
    """The index after the last line of the block of ``lines[at]`` (its deeper-indented children)."""
    indent, end = _indent(lines[at]), at + 1
    for i in range(at + 1, len(lines)):
        if _content(lines[i]):
            if _indent(lines[i]) <= indent:
                break
            end = i + 1
    return end


def _comment(line: str) -> str:
    """The trailing comment of a ``key: value  # ...`` line (with its spacing), or ""."""
    head, sep, tail = line.rstrip("\n").partition(" #")
    if not sep or head.count('"') % 2 or head.count("'") % 2:  # a " #" inside a quoted value
        return ""
    return " " * (len(head) - len(head.rstrip()) + 1) + "#" + tail


def set_field(text: str, dotted: str, value: Any, note: str | None = None) -> str:
    """``text`` with ``dotted`` (``weight_sync.params``) set to ``value``: the line is replaced (its children
    too, for a section replaced by a flow value) keeping its comment unless ``note`` replaces it; a missing
    key is appended to its section, and missing sections are created the same way."""
    lines = text.splitlines(keepends=True)
    start, end, indent = 0, len(lines), 0
    parts = dotted.split(".")
    for depth, key in enumerate(parts):
        found = next(
            (
                i
                for i in range(start, end)
                if _content(lines[i])
                and _indent(lines[i]) == indent
                and lines[i].lstrip(" ").startswith(f"{key}:")
            ),
            None,
        )
        last = depth == len(parts) - 1
        if found is None:  # after the section's last line (the file's, at the top level)
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            lines[end:end] = _new_lines(indent, key, value, parts[depth + 1 :], note)
            return "".join(lines)
        if last:
            comment = f"  # {note}" if note else _comment(lines[found])
            lines[found : _block_end(lines, found)] = [f"{' ' * indent}{key}: {render(value)}{comment}\n"]
            return "".join(lines)
        start, end = found + 1, _block_end(lines, found)
        children = [i for i in range(start, end) if _content(lines[i])]
        indent = _indent(lines[children[0]]) if children else indent + 2
    raise AssertionError("unreachable")


def _new_lines(indent: int, key: str, value: Any, rest: list[str], note: str | None) -> list[str]:
    """Lines for ``key`` (and the ``rest`` of a dotted path below it) set to ``value``, at ``indent``."""
    if not rest:
        return [f"{' ' * indent}{key}: {render(value)}{f'  # {note}' if note else ''}\n"]
    return [f"{' ' * indent}{key}:\n", *_new_lines(indent + 2, rest[0], value, rest[1:], note)]
