"""Every hook spec is documented (when / parameters / returns / versionadded, typed signature) and
exercised: implemented by some plugin in the repo or called by the code (as datasette's
``test_plugin_hooks`` does). Generic over whatever ``relax.core.hookspecs`` holds."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from relax.core import hookspecs

REPO = Path(__file__).resolve().parents[4]
SECTIONS = ("When:", "Parameters:", "Returns:", ".. versionadded::")


def hook_specs() -> dict[str, object]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, "relax_spec")
    }


def doc_problems(fn) -> list[str]:
    doc = inspect.getdoc(fn) or ""
    problems = [f"docstring lacks {s!r}" for s in SECTIONS if s not in doc]
    if doc and not doc.splitlines()[0].strip():
        problems.append("docstring has no summary line")
    sig = inspect.signature(fn)
    problems += [
        f"parameter {p!r} has no type annotation"
        for p, v in sig.parameters.items()
        if v.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty:
        problems.append("no return annotation")
    return problems


def source_files() -> list[Path]:
    """Non-test Python sources: every workspace package's ``src`` and the examples."""
    roots = [*REPO.glob("packages/*/src"), REPO / "examples"]
    return [
        p
        for root in roots
        for p in root.rglob("*.py")
        if p.resolve() != Path(hookspecs.__file__).resolve() and "tests" not in p.parts
    ]


@pytest.fixture(scope="module")
def sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in source_files()}


def uses(name: str, sources: dict[Path, str]) -> tuple[list[str], list[str]]:
    """(files implementing ``name``, files calling or dispatching to it)."""
    impl = re.compile(rf"^\s*def\s+{name}\s*\(", re.M)
    call = re.compile(rf"\.{name}\b|[\"']{name}[\"']")  # hook.name(...) / a dispatch table
    rel = {p: str(p.relative_to(REPO)) for p in sources}
    return (
        [rel[p] for p, text in sources.items() if impl.search(text)],
        [rel[p] for p, text in sources.items() if call.search(text)],
    )


def test_specs_are_found():
    names = set(hook_specs())
    assert {"relax_register_rollout_engines", "relax_register_trainers", "relax_filter_group"} <= names, names


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_spec_is_documented(name):
    assert not doc_problems(hook_specs()[name]), f"{name}: {doc_problems(hook_specs()[name])}"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_spec_is_implemented_or_called(name, sources):
    implemented, called = uses(name, sources)
    assert implemented or called, f"{name} is neither implemented by a plugin nor called anywhere in {REPO}"


def test_the_checks_can_fail(sources):
    def relax_undocumented(x):
        """Does something."""

    assert len(doc_problems(relax_undocumented)) == len(SECTIONS) + 2
    assert uses("relax_no_such_hook_anywhere", sources) == ([], [])
    implemented, called = uses("relax_register_rewards", sources)
    assert "packages/relax-core/src/relax/core/builtin.py" in implemented
