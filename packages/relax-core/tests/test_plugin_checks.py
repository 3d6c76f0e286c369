"""Issue 42: the plugin machinery's checks a plugin author meets first -- a plugin loaded twice (an installed
entry point and ``RELAX_PLUGINS``), ``relax plugins`` showing lifecycle hooks, ``relax validate`` refusing an
environment answered with tool calls under ``tool_parser: none`` and building no ``inputs`` model."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest

from relax.core import cli, plugins
from relax.core.errors import ConfigError
from relax.core.hookspecs import hookimpl
from relax.core.plugins import PluginError, RelaxPluginManager, format_plugins

sys.path.insert(0, str(Path(__file__).parent / "agentic"))
import lookup_env  # noqa: E402  (a real environment plugin: tests/agentic/lookup_env.py)

BODY = """
from relax.core.hookspecs import hookimpl

@hookimpl
def relax_on_step_end(step, metrics):
    pass
"""


def test_a_plugin_installed_and_listed_in_relax_plugins_is_an_error_naming_both(tmp_path, monkeypatch):
    (tmp_path / "twice_plugin.py").write_text(textwrap.dedent(BODY))
    info = (
        tmp_path / "relax_twice-0.1.0.dist-info"
    )  # a real installed distribution, as importlib.metadata sees it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: relax-twice\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[relax]\ntwice = twice_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RELAX_PLUGINS", "twice_plugin")
    with pytest.raises(PluginError) as err:
        RelaxPluginManager()
    message = str(err.value)
    assert (
        "plugin module 'twice_plugin' is loaded twice: as plugin 'twice' (entry point of distribution "
        "relax-twice 0.1.0) and as plugin 'twice_plugin' (RELAX_PLUGINS)" in message
    )
    assert "RELAX_DISABLE_PLUGINS=twice_plugin" in message
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "twice_plugin")  # the documented way out: one of them
    assert "twice" in RelaxPluginManager().infos


def test_relax_plugins_lists_lifecycle_hooks(monkeypatch):
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")
    listing = format_plugins(
        RelaxPluginManager(load_entry_points=False, extra_plugins={"lookup_env": lookup_env})
    )
    assert listing.splitlines() == [
        "lookup_env ((in-process) -)",
        "  environment: lookup",
        "  tool_parser: lookup_calls",
        "  hooks: relax_on_step_end",
    ]


@pytest.fixture
def built(tmp_path):
    return tmp_path / "built_by_inputs"


@pytest.fixture
def with_plugins(monkeypatch, built):
    """``lookup_env`` plus an ``inputs`` plugin that records being built, in the process-wide manager."""
    inputs = types.ModuleType("marker_inputs")

    def make(params, ctx):
        built.mkdir()
        return {"data.path": str(built / "train.jsonl")}

    @hookimpl
    def relax_register_inputs(register):
        register("marker", make, fills=("data.path",))

    inputs.relax_register_inputs = relax_register_inputs
    manager = RelaxPluginManager(extra_plugins={"lookup_env": lookup_env, "marker_inputs": inputs})
    monkeypatch.setattr(plugins, "_MANAGER", manager)


def test_validate_refuses_tool_parser_none_for_an_environment_answered_with_tool_calls(
    with_plugins, tmp_path, capsys
):
    base = [f"run_dir={tmp_path / 'run'}", "environment.name=lookup", "reward.name=environment"]
    with pytest.raises(
        ConfigError,
        match=r"environment.tool_parser: 'none' finds no tool call, but environment 'lookup' "
        r"is answered with tool calls \(registered with tool_calls=True\); set one of: "
        r".*lookup_calls",
    ):
        cli.cmd_validate(cli.build_parser().parse_args(["validate", *base]))
    assert cli.main(["validate", *base, "environment.tool_parser=lookup_calls"]) == 0


def test_validate_builds_no_inputs_model_and_says_what_run_builds(with_plugins, tmp_path, built, capsys):
    assert cli.main(["validate", f"run_dir={tmp_path / 'run'}", "inputs.name=marker"]) == 0
    out = capsys.readouterr().out
    assert not built.exists()  # the plugin's factory was not called
    assert "note: inputs 'marker' builds data.path on the first `relax run` (not built by validate" in out
