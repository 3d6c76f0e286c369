"""``inputs.name``: a plugin builds a config's null model / data paths on first use (``relax_register_inputs``)."""

from __future__ import annotations

import pytest

from relax.core.config import ConfigError, load_config
from relax.core.plugins import get_plugin_manager
from relax.core.quickstart_model import ensure_quickstart_model
from relax.core.tasks.arithmetic import write_arithmetic_jsonl


@pytest.fixture
def registered(tmp_path):
    calls = []

    def build(params, ctx):
        calls.append(ctx.run_dir)
        data = tmp_path / "made" / "rows.jsonl"
        if not data.exists():
            data.parent.mkdir(exist_ok=True)
            write_arithmetic_jsonl(data, 20)
        return {"model.path": ensure_quickstart_model(), "data.path": str(data)}

    manager = get_plugin_manager()
    manager.registry.add("inputs", "made_here", build, "test", options={"fills": ("model.path", "data.path")})
    manager.registry.add(
        "inputs",
        "forgets",
        lambda p, c: {"model.path": ensure_quickstart_model()},
        "test",
        options={"fills": ("model.path", "data.path")},
    )
    yield calls
    get_plugin_manager(refresh=True)


def test_null_paths_are_built_and_set_where_the_config_left_them(registered, tmp_path):
    cfg = load_config(
        None,
        ["inputs.name=made_here", "model.path=null", "data.path=null", f"run_dir={tmp_path / 'run'}"],
        check_paths=True,
    )
    assert (
        cfg.data.path == str(tmp_path / "made" / "rows.jsonl") and cfg.model.path == ensure_quickstart_model()
    )
    assert registered == [str(tmp_path / "run")]
    mine = tmp_path / "mine.jsonl"
    write_arithmetic_jsonl(mine, 5, seed=1)
    cfg = load_config(None, ["inputs.name=made_here", f"data.path={mine}"], check_paths=True)
    assert cfg.data.path == str(mine)  # the user's own path wins
    load_config(None, ["inputs.name=made_here"], check_paths=False)  # only a run or validate builds
    assert len(registered) == 2


def test_unknown_or_incomplete_inputs_are_named(registered):
    with pytest.raises(ConfigError, match="inputs.name: unknown inputs 'nope'"):
        load_config(None, ["inputs.name=nope"])
    with pytest.raises(ValueError, match=r"inputs 'forgets' declared it fills \['data.path'\]"):
        load_config(None, ["inputs.name=forgets"], check_paths=True)
