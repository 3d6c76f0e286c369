"""Core's code knows no model family: family code lives in plugins behind ``relax_register_model_adapters``
(relax-omni registers the Qwen VL / Omni adapters). Identifiers and string literals of
``relax-core/src`` are scanned with ``tokenize``; comments and docstrings may name families. The quick-start
model (a Qwen3 architecture) and the test kit's three text models built on that architecture (the tiny one, a
Qwen3-MoE and the sharded-memory model) are the allowed exceptions; the tiny VL / Omni models live in
relax-omni (``relax.omni.tiny_models``), so the rest of ``relax.core.testing`` is scanned like any code;
the recipes and their datasets are plugins too (``relax_register_recipes`` / ``_datasets``: relax-rewards'
text math ones, relax-omni's media ones), so ``relax.core.recipes`` is machinery and scanned like the rest."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "relax" / "core"
ALLOWED = ("testing/models.py", "testing/moe_models.py", "testing/sharded_rss.py", "quickstart_model.py")
FAMILY = re.compile(
    r"qwen|omni|thinker|llama|gemma|glm|mistral|mixtral|deepseek|internvl|mrope|m_rope|rope_delta|audio_in_video",
    re.IGNORECASE,
)
# the plugin to install, named in core's error for a media model without an adapter: a package, not model code
PLUGIN_PACKAGE = re.compile(r"\brelax-omni\b")
# identifiers and string literals; an f-string's literal parts are their own tokens from Python 3.12
CODE_TOKENS = (tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING))


def docstring_lines(tree: ast.AST) -> set[int]:
    """First lines of every module / class / function docstring (their tokens start there)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.add(first.lineno)
    return lines


def family_names(source: str) -> list[tuple[int, str]]:
    """(line, token) of every identifier or string literal (docstrings aside) naming a model family."""
    docs = docstring_lines(ast.parse(source))
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.start[0] in docs:
            continue
        if tok.type in CODE_TOKENS and FAMILY.search(PLUGIN_PACKAGE.sub("", tok.string)):
            hits.append((tok.start[0], tok.string))
    return hits


def test_the_scanner_sees_names_and_strings_but_not_comments_or_docstrings():
    source = (
        '"""Qwen docstring."""\n'
        "# a Gemma comment\n"
        "def load_qwen(path):\n"
        '    """Mistral docstring."""\n'
        '    return {"thinker.visual.": path, "x": f"{path}rope_deltas"}  # llama\n'
        'HINT, FAMILY = "install relax-omni", "omni_thinker"\n'
    )
    hits = [t for _, t in family_names(source)]
    assert hits[:2] == ["load_qwen", '"thinker.visual."'] and len(hits) == 4 and "rope_deltas" in hits[2]
    assert hits[3] == '"omni_thinker"'  # the plugin's package name in a hint is no family code


def test_core_source_names_no_model_family():
    files = [p for p in sorted(SRC.rglob("*.py")) if not p.relative_to(SRC).as_posix().startswith(ALLOWED)]
    assert (
        len(files) > 50
        and SRC / "multimodal_model.py" in files
        and SRC / "engines" / "multimodal.py" in files
        and SRC / "recipes" / "catalog.py" in files  # the recipes are plugins': core's part names no model
        and SRC / "testing" / "multimodal.py" in files  # the media kit builds no family of its own
    )
    found = {f"{p.relative_to(SRC)}:{line}": tok for p in files for line, tok in family_names(p.read_text())}
    assert not found, (
        f"model-family names in relax-core/src code (move them into a model adapter plugin): {found}"
    )


PACKAGES = SRC.parents[3]
# the backends learn a family only through its model adapter (``relax.core.model_family``): their code names none.
# ``mrope`` is megatron-core's own name for 3-D rotary positions (``position_embedding_type="mrope"``), not a
# family. Exempt: relax-sglang's test kit (as core's ``testing/``) and ``server_site/``, patches of SGLang's own
# model modules loaded inside the SGLang server's interpreter, where Relax's plugin registry does not run.
BACKEND_FAMILY = re.compile(FAMILY.pattern.replace("|mrope|m_rope", ""), re.IGNORECASE)
BACKENDS = {"relax-megatron": ("megatron", ()), "relax-sglang": ("sglang", ("testing.py", "server_site/"))}


def backend_family_names(source: str) -> list[tuple[int, str]]:
    return [(line, tok) for line, tok in family_names(source) if BACKEND_FAMILY.search(tok)]


def test_the_backend_scanner_allows_megatrons_rotary_name_only():
    hits = backend_family_names('kind = "mrope"\nTYPES = ("qwen3_vl",)\nglm = 1\n')
    assert [t for _, t in hits] == ['"qwen3_vl"', "glm"]


@pytest.mark.parametrize("package", sorted(BACKENDS))
def test_backend_source_names_no_model_family(package):
    module, allowed = BACKENDS[package]
    src = PACKAGES / package / "src" / "relax" / module
    files = [p for p in sorted(src.rglob("*.py")) if not p.relative_to(src).as_posix().startswith(allowed)]
    assert len(files) > 10
    found = {
        f"{p.relative_to(src)}:{line}": tok
        for p in files
        for line, tok in backend_family_names(p.read_text())
    }
    assert not found, (
        f"model-family names in {package}/src code (declare them in the family's model adapter: "
        f"relax.core.model_family): {found}"
    )


@pytest.mark.parametrize("module", ["multimodal_model", "engines.multimodal", "engines.hf", "engines.static"])
def test_core_imports_no_plugin(module):
    """The dispatch reads the adapter registry; it never imports the plugin that fills it."""
    source = (SRC / f"{module.replace('.', '/')}.py").read_text()
    imported = [n.module or "" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    assert imported and not [
        m for m in imported if m.startswith(("relax.omni", "relax.sglang", "relax.megatron"))
    ]
