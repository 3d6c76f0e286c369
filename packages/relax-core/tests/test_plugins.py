"""Plugin discovery: built-ins via the entry point, a separately installed distribution, errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from relax.core.hookspecs import hookimpl
from relax.core.plugins import PluginError, RelaxPluginManager, UnknownNameError, format_plugins


def _write_distribution(root: Path, dist: str, module: str, entry_name: str, body: str) -> None:
    """A real installed distribution as importlib.metadata sees it: module + .dist-info with entry points."""
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text(f"[relax]\n{entry_name} = {module}\n")
    (info / "RECORD").write_text("")


PLUGIN_BODY = """
from relax.core.hookspecs import hookimpl

class ConstantReward:
    async def score(self, sample):
        return 0.5

@hookimpl
def relax_register_rewards(register):
    register("constant_half", lambda params, ctx: ConstantReward())
"""


def _relax(args: list[str], pythonpath: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(pythonpath), **env}
    return subprocess.run(
        [sys.executable, "-m", "relax.core.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def test_builtins_are_registered_through_the_core_entry_point():
    manager = RelaxPluginManager()
    assert "core" in manager.infos
    assert manager.infos["core"].distribution == "relax-core"
    for kind, name in [
        ("rollout_engine", "hf"),
        ("trainer", "torch"),
        ("reward", "numeric"),
        ("advantage", "grpo"),
        ("policy_loss", "ppo"),
        ("kl", "k3"),
        ("weight_sync", "object_store"),
    ]:
        assert name in manager.names(kind), (kind, name)
        assert (kind, name) in manager.infos["core"].registered


def test_external_distribution_is_discovered_and_listed(tmp_path):
    _write_distribution(tmp_path, "relax-foo", "relax_foo_plugin", "foo", PLUGIN_BODY)
    proc = _relax(["plugins"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "foo (relax-foo 0.3.1)" in proc.stdout
    assert "reward: constant_half" in proc.stdout
    assert "core (relax-core" in proc.stdout
    # and config validation accepts the plugin's name
    proc = _relax(["validate", "reward.name=constant_half"], tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_disable_plugins_env(tmp_path):
    _write_distribution(tmp_path, "relax-foo", "relax_foo_plugin", "foo", PLUGIN_BODY)
    proc = _relax(["plugins"], tmp_path, RELAX_DISABLE_PLUGINS="foo")
    assert proc.returncode == 0, proc.stderr
    assert "relax-foo" not in proc.stdout and "core (relax-core" in proc.stdout


def test_duplicate_name_names_both_plugins(tmp_path):
    body = PLUGIN_BODY.replace("constant_half", "numeric")
    _write_distribution(tmp_path, "relax-dup", "relax_dup_plugin", "dup", body)
    proc = _relax(["plugins"], tmp_path)
    assert proc.returncode != 0
    assert "duplicate reward name 'numeric'" in proc.stderr
    assert "'core'" in proc.stderr and "'dup'" in proc.stderr


def test_in_process_plugin_and_unknown_name_error(monkeypatch):
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")
    mod = types.ModuleType("myplug")

    @hookimpl
    def relax_register_algorithms(register):
        register("my_adv", lambda inputs: None, kind="advantage")

    mod.relax_register_algorithms = relax_register_algorithms
    manager = RelaxPluginManager(extra_plugins={"myplug": mod})
    assert manager.names("advantage") == ["my_adv"]
    with pytest.raises(
        UnknownNameError, match=r"unknown advantage 'nope'; registered advantage names: \['my_adv'\]"
    ):
        manager.get("advantage", "nope")
    assert "myplug ((in-process) -)\n  advantage: my_adv" in format_plugins(manager)


def test_in_driver_is_declared_at_registration_by_builtins_and_plugins_alike():
    def plugin(in_driver):
        mod = types.ModuleType("ruleplug")

        @hookimpl
        def relax_register_rewards(register):
            register("rule", lambda params, ctx: None, in_driver=in_driver)
            register("judge", lambda params, ctx: None)

        mod.relax_register_rewards = relax_register_rewards
        return mod

    manager = RelaxPluginManager(extra_plugins={"ruleplug": plugin(True)})
    declared = {name: manager.registration("reward", name).in_driver for name in manager.names("reward")}
    assert {k: declared[k] for k in ("numeric", "exact_match", "rule", "judge")} == {
        "numeric": True,
        "exact_match": True,
        "rule": True,
        "judge": False,
    }
    assert manager.registration("rollout_engine", "hf").in_driver is False  # the default: an actor of its own
    with pytest.raises(
        PluginError, match=r"plugin 'ruleplug': reward 'rule' in_driver= must be True or False, got 'yes'"
    ):
        RelaxPluginManager(extra_plugins={"ruleplug": plugin("yes")})


def test_algorithm_registration_requires_kind(monkeypatch):
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")
    mod = types.ModuleType("badplug")

    @hookimpl
    def relax_register_algorithms(register):
        register("x", lambda: None)

    mod.relax_register_algorithms = relax_register_algorithms
    with pytest.raises(PluginError, match="needs kind= one of"):
        RelaxPluginManager(extra_plugins={"badplug": mod})


def test_lifecycle_hooks_are_called(monkeypatch):
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")
    seen = []
    mod = types.ModuleType("observer")

    @hookimpl
    def relax_on_step_end(step, metrics):
        seen.append((step, metrics["reward/mean"]))

    @hookimpl
    def relax_filter_group(group):
        return len(group) > 1

    mod.relax_on_step_end = relax_on_step_end
    mod.relax_filter_group = relax_filter_group
    manager = RelaxPluginManager(extra_plugins={"observer": mod})
    manager.hook.relax_on_step_end(step=3, metrics={"reward/mean": 0.5})
    assert seen == [(3, 0.5)]
    assert manager.hook.relax_filter_group(group=[1]) == [False]


def test_relax_plugins_env_loads_unpackaged_module(tmp_path):
    (tmp_path / "my_local_plugin.py").write_text(textwrap.dedent(PLUGIN_BODY))
    proc = _relax(["plugins"], tmp_path, RELAX_PLUGINS="my_local_plugin")
    assert proc.returncode == 0, proc.stderr
    assert "my_local_plugin ((RELAX_PLUGINS) -)\n  reward: constant_half" in proc.stdout
    proc = _relax(["plugins"], tmp_path, RELAX_PLUGINS="no_such_module_xyz")
    assert proc.returncode != 0 and "cannot import plugin module 'no_such_module_xyz'" in proc.stderr


def test_misspelt_hook_is_an_error_naming_the_plugin(monkeypatch):
    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")
    mod = types.ModuleType("typoplug")

    def relax_register_reward(register):  # missing "s"; unmarked functions count too
        register("x", lambda params, ctx: None)

    mod.relax_register_reward = relax_register_reward
    with pytest.raises(
        PluginError, match=r"plugin 'typoplug'.*relax_register_reward.*known hooks: .*relax_register_rewards"
    ):
        RelaxPluginManager(extra_plugins={"typoplug": mod})


def test_registration_goes_through_pm_hook_with_typed_config(monkeypatch):
    """Registrations are attributed per plugin, keep their config class, and a hook that raises is
    reported with the plugin's name."""
    from dataclasses import dataclass

    monkeypatch.setenv("RELAX_DISABLE_PLUGINS", "core")

    @dataclass(frozen=True)
    class Params:
        k: int = 1

    calls = []
    good, bad = types.ModuleType("good"), types.ModuleType("bad")

    def good_rewards(register):
        calls.append("good")
        register("r", lambda params, ctx: None, config=Params)

    def bad_rewards(register):
        raise RuntimeError("boom")

    good.relax_register_rewards = good_rewards
    bad.relax_register_rewards = bad_rewards
    manager = RelaxPluginManager(extra_plugins={"good": good})
    assert calls == ["good"]
    reg = manager.registration("reward", "r")
    assert (reg.plugin, reg.config) == ("good", Params)
    with pytest.raises(PluginError, match=r"plugin 'bad': relax_register_rewards raised RuntimeError: boom"):
        RelaxPluginManager(extra_plugins={"good": good, "bad": bad})
    notdc = types.ModuleType("notdc")
    notdc.relax_register_rewards = lambda register: register("q", lambda p, c: None, config=dict)
    with pytest.raises(PluginError, match="config= must be a dataclass"):
        RelaxPluginManager(extra_plugins={"notdc": notdc})


def test_plugin_command_clashing_with_a_builtin_is_an_error(tmp_path):
    (tmp_path / "clash_plugin.py").write_text(
        "def relax_register_commands(register):\n    register('run', lambda ns: 0, help='x')\n"
    )
    proc = _relax(["plugins"], tmp_path, RELAX_PLUGINS="clash_plugin")
    assert proc.returncode == 2
    assert "plugin 'clash_plugin' registered command 'run', which is a built-in relax command" in proc.stderr
