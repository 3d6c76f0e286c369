"""docs/hookspecs.md is generated from relax.core.hookspecs and must stay current."""

from __future__ import annotations

import re
from pathlib import Path

from relax.core import hookspecs
from relax.core.hookspec_docs import hook_specs, hookspec_reference_markdown

REPO = Path(__file__).resolve().parents[3]


def test_docs_hookspec_reference_is_current():
    assert (REPO / "docs" / "hookspecs.md").read_text() == hookspec_reference_markdown(), (
        "docs/hookspecs.md is stale: run `python -m relax.core.hookspec_docs > docs/hookspecs.md`"
    )


def test_every_hook_spec_is_documented_with_its_version():
    page = hookspec_reference_markdown()
    names = {
        n for n in vars(hookspecs) if n.startswith("relax_") and hasattr(getattr(hookspecs, n), "relax_spec")
    }
    assert {f.__name__ for f in hook_specs()} == names and len(names) >= 8
    for name in names:
        section = page.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        assert "*Added in " in section, f"{name}: its docstring has no versionadded"
    assert not re.search(r"(?<!`)``(?!`)", page) and ".. version" not in page  # RST converted to markdown
