"""Relative paths in a config file resolve against the current directory; one that is missing there but
exists relative to the config file's directory (or a parent of it) gets an error saying where and how to fix it."""

from __future__ import annotations

import json

import pytest

from relax.core.config import ConfigError, load_config
from relax.core.tasks.arithmetic import write_arithmetic_jsonl


@pytest.fixture
def project(tmp_path):
    """``tmp/proj/configs/run.yaml`` naming ``data/rows.jsonl`` (which lives at ``tmp/proj/configs/data``) and
    ``shared/rows.jsonl`` (at ``tmp/proj/shared``, relative to a parent of the config's directory)."""
    configs = tmp_path / "proj" / "configs"
    (configs / "data").mkdir(parents=True)
    (tmp_path / "proj" / "shared").mkdir()
    write_arithmetic_jsonl(configs / "data" / "rows.jsonl", 5)
    write_arithmetic_jsonl(tmp_path / "proj" / "shared" / "rows.jsonl", 5)
    (configs / "run.yaml").write_text(
        json.dumps({"data": {"path": "data/rows.jsonl"}, "run_dir": str(tmp_path / "r")})
    )
    return configs


def test_missing_from_cwd_but_beside_the_config_says_so(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(project / "run.yaml", check_paths=True)
    message = str(err.value)
    assert (
        "data.path: 'data/rows.jsonl' does not exist -- relative paths resolve against the current directory"
        in message
    )
    assert f"exists relative to {project} (the config file's directory): run relax from {project}" in message
    assert f"override data.path={project / 'data' / 'rows.jsonl'}" in message
    monkeypatch.chdir(project)  # the rule: from there it loads
    assert load_config(project / "run.yaml", check_paths=True).data.path == "data/rows.jsonl"


def test_a_parent_of_the_config_directory_is_named_too(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"exists relative to .*proj \(a parent of the config file\)"):
        load_config(project / "run.yaml", ["data.path=shared/rows.jsonl"], check_paths=True)


def test_no_hint_when_the_path_exists_nowhere_or_is_absolute(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("data/nope.jsonl", str(tmp_path / "nope.jsonl")):
        with pytest.raises(ConfigError) as err:
            load_config(project / "run.yaml", [f"data.path={path}"], check_paths=True)
        assert "does not exist" in str(err.value) and "relative paths resolve" not in str(err.value)
