"""``relax init``: the written starter config validates in every mode, keeps its comments, and an existing file
is never overwritten without ``--force`` (a plugin's recipes: test_catalog.py here, and the plugins' own tests)."""

from __future__ import annotations

import pytest
import yaml

from relax.core.cli import main
from relax.core.config import load_config
from relax.core.errors import ConfigError
from relax.core.recipes.starter import MODES, starter_text, template, validate_text
from relax.core.recipes.yaml_edit import set_field


@pytest.mark.parametrize("mode", [None, *MODES])
def test_every_mode_of_the_starter_validates(mode):
    text = starter_text(None, mode)
    cfg = validate_text(text)
    assert cfg.mode == (mode or yaml.safe_load(template())["mode"])
    assert cfg.max_staleness == (0 if cfg.mode == "colocate" else 1)
    assert text.startswith("# ") and text.count("\n#") >= 3  # the commentary survives the edit


def test_cli_writes_refuses_to_overwrite_and_forces(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    written = (tmp_path / "relax.yaml").read_text()
    assert written == template() and "relax run relax.yaml" in capsys.readouterr().out
    load_config(
        tmp_path / "relax.yaml", check_paths=True
    )  # null paths: the quick-start's, built on first use
    (tmp_path / "relax.yaml").write_text("mine\n")
    assert main(["init"]) == 2
    assert "relax.yaml exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "relax.yaml").read_text() == "mine\n"
    assert main(["init", "--force", "--mode", "async"]) == 0
    assert load_config(tmp_path / "relax.yaml").mode == "async"


def test_unknown_recipe_and_mode_are_refused():
    with pytest.raises(ConfigError, match="--recipe: unknown recipe 'nope'; installed: "):
        starter_text("nope")
    with pytest.raises(SystemExit):
        main(["init", "--mode", "turbo"])


SECTION = """\
# head
mode: async          # why async
weight_sync:
  transport: broadcast   # a comment
  params:
    backend: nccl
  bucket_mb: 512
note: "a # in quotes"
"""


def test_set_field_keeps_lines_and_comments():
    out = set_field(SECTION, "mode", "colocate")
    assert "mode: colocate          # why async\n" in out and out.replace("colocate", "async", 1) == SECTION
    out = set_field(
        SECTION, "weight_sync.params", {}
    )  # a section replaced by a flow value drops its children
    assert "  params: {}\n  bucket_mb: 512\n" in out and "backend" not in out
    out = set_field(SECTION, "weight_sync.transport", "object_store", note="across nodes")
    assert "  transport: object_store  # across nodes\n" in out
    out = set_field(SECTION, "rollout.release_memory", True)  # missing section and key: appended
    assert out.endswith("rollout:\n  release_memory: true\n") and yaml.safe_load(out)["rollout"] == {
        "release_memory": True
    }
    out = set_field(SECTION, "weight_sync.every_n_steps", 2)  # missing key: at the end of its section
    assert "  bucket_mb: 512\n  every_n_steps: 2\nnote:" in out
    out = set_field(SECTION, "note", "plain")
    assert "note: plain\n" in out  # " #" inside the quoted value was no comment
