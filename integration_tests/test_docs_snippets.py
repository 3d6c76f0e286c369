"""Every YAML config block and every ``relax ...`` command line in the README and the docs is checked:
a YAML block must validate as a Relax config (what ``relax validate`` does, minus the checks that
need its data/model paths to exist on this machine), a command line must parse with the real CLI
parser, and a ``relax run|validate <config in this repo> [overrides]`` must validate. Docs whose
snippets drift from the code fail here, not in a user's terminal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from relax.core.cli import build_parser
from relax.core.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

#: (page, first line of the block) -> why it is not a whole config. Empty on purpose so far: add an
#: entry only with its reason.
NOT_A_CONFIG: dict[tuple[str, str], str] = {
    (
        "docs/plugins.md",
        "reward:",
    ): "selects the `length` reward of the example plugin examples/plugins/relax-hello, "
    "which the workspace does not install; integration_tests/test_example_plugin.py installs it and validates "
    "and runs the `length` reward",
}
INLINE = re.compile(r"`(relax (?:run|validate) [^`]+)`")


def _blocks(kind: set[str]) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text()):
            if lang in kind:
                found.append((page.relative_to(REPO).as_posix(), body))
    return found


YAML_BLOCKS = _blocks({"yaml", "yml"})
COMMANDS = [
    (page, line)
    for page, body in _blocks({"bash", "sh", "shell", "console"})
    for raw in body.splitlines()
    if (line := raw.strip().removeprefix("$ ").strip()).startswith("relax ")
]

# inline `relax run|validate <a config of this repo> ...` in prose: validated as well
COMMANDS += [
    (page.relative_to(REPO).as_posix(), cmd)
    for page in PAGES
    for cmd in sorted(set(INLINE.findall(page.read_text())))
    if (REPO / cmd.split()[2]).is_file() and (page.relative_to(REPO).as_posix(), cmd) not in COMMANDS
]


def config_problem(body: str, scratch: Path) -> str | None:
    """Why a YAML block is not a valid Relax config (None if it is)."""
    data = yaml.safe_load(body)
    if not isinstance(data, dict):
        return f"not a mapping: {type(data).__name__}"
    cfg_file = scratch / "snippet.yaml"
    cfg_file.write_text(body)
    try:
        load_config(cfg_file)
    except ConfigError as exc:
        return str(exc)
    return None


def command_problem(line: str) -> str | None:
    """Why a ``relax ...`` line does not parse (or, naming a config of this repo, does not validate)."""
    argv = shlex.split(line, comments=True)[1:]
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit:
        return "does not parse with the relax CLI"
    if ns.command in ("run", "validate") and ns.args and (REPO / ns.args[0]).is_file():
        try:  # a config of this repo: the whole command line (overrides included) must validate
            load_config(REPO / ns.args[0], ns.args[1:])
        except ConfigError as exc:
            return f"does not validate: {exc}"
    return None


def test_the_docs_have_snippets_to_check():
    assert len(YAML_BLOCKS) >= 3 and len(COMMANDS) >= 3, (len(YAML_BLOCKS), len(COMMANDS))


def test_the_checks_catch_a_drifted_snippet(tmp_path):
    assert "mode: 'turbo' is not allowed" in config_problem("mode: turbo\n", tmp_path)
    assert "trainer.lrr" in config_problem("trainer: {lrr: 1.0e-6}\n", tmp_path)
    assert command_problem("relax runn examples/quickstart.yaml") == "does not parse with the relax CLI"
    assert "rollout.temperature" in command_problem(
        "relax run examples/quickstart.yaml rollout.temperature=-1"
    )
    assert command_problem("relax validate examples/quickstart.yaml total_steps=3  # a comment") is None


@pytest.mark.parametrize(
    ("page", "body"), YAML_BLOCKS, ids=[f"{p}:{b.splitlines()[0][:40]}" for p, b in YAML_BLOCKS]
)
def test_yaml_block_validates(page, body, tmp_path):
    key = (page, body.splitlines()[0])
    if key in NOT_A_CONFIG:
        pytest.skip(NOT_A_CONFIG[key])
    problem = config_problem(body, tmp_path)
    assert problem is None, f"{page}: this YAML block does not validate:\n{body}\n{problem}"


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{c[:50]}" for p, c in COMMANDS])
def test_cli_line_is_valid(page, line):
    problem = command_problem(line)
    assert problem is None, f"{page}: `{line}` {problem}"
