"""The ``eval`` section is validated like the rest of the config: every problem names its field."""

from __future__ import annotations

import pytest

from relax.core.config import ConfigError, load_config


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


def test_a_valid_section_loads_typed():
    cfg = load_config(
        None,
        [
            "data.task_heldout=4",
            "eval.every_n_steps=5",
            "eval.sets.h.path=null",
            "eval.sets.s.path=x.jsonl",
            "eval.sets.s.n_samples=4",
            "eval.sets.s.temperature=0.7",
            "eval.sets.s.reward.name=exact_match",
        ],
    )
    s = cfg.eval.sets["s"]
    assert (s.n_samples, s.temperature, s.reward.name, s.reward.timeout_s) == (4, 0.7, "exact_match", 30.0)
    assert cfg.eval.sets["h"].reward is None and cfg.eval.sets["h"].temperature == 0.0  # greedy by default


def test_every_bad_field_is_named():
    msg = _errors(
        "eval.every_n_steps=-1",
        "eval.sets.a.path=x.jsonl",
        "eval.sets.a.n_samples=0",
        "eval.sets.b.path=x.jsonl",
        "eval.sets.b.temperature=-1",
        "eval.sets.b.top_p=2",
        "eval.sets.c.path=x.jsonl",
        "eval.sets.c.n_samples=4",
        "eval.sets.d.path=x.txt",
        "eval.sets.e.path=null",
        "data.task_heldout=-1",
    )
    for expected in (
        "eval.every_n_steps: must be >= 0",
        "eval.sets.a.n_samples: must be >= 1",
        "eval.sets.b.temperature: must be >= 0",
        "eval.sets.b.top_p: must be in (0, 1]",
        "eval.sets.c.n_samples: 4 greedy responses",
        "eval.sets.d.path: 'x.txt' must be a .jsonl",
        "eval.sets.e.path: null means the quick-start task's held-out split",
        "data.task_heldout: must be >= 0",
    ):
        assert expected in msg, (expected, msg)
    assert "eval.sets.f.nope: unknown key; allowed keys: path," in _errors(
        "eval.sets.f.path=x.jsonl", "eval.sets.f.nope=1"
    )


def test_plugins_and_their_params_are_checked_per_set():
    msg = _errors(
        "eval.sets.a.path=x.jsonl",
        "eval.sets.a.reward.name=nope",
        "eval.sets.b.path=x.jsonl",
        "eval.sets.b.reward.name=numeric",
        "eval.sets.b.reward.params.mode=middle",
        "eval.sets.c.path=x.jsonl",
        "eval.sets.c.environment.name=nope",
    )
    assert "eval.sets.a.reward.name: unknown reward 'nope'; registered:" in msg
    assert "eval.sets.b.reward.params.mode: 'middle' is not allowed" in msg
    assert "eval.sets.c.environment.name: unknown environment 'nope'" in msg


def test_a_hub_reward_set_validates_its_routes():
    pytest.importorskip("relax.rewards")
    cfg = load_config(
        None,
        [
            "eval.sets.m.path=x.jsonl",
            "eval.sets.m.reward.name=hub",
            "eval.sets.m.reward.params.routes={math: numeric}",
            "eval.sets.m.reward.params.default=math",
        ],
    )
    assert cfg.eval.sets["m"].reward.params["routes"] == {"math": "numeric"}
    assert "eval.sets.m.reward.params.workers" in _errors(
        "eval.sets.m.path=x.jsonl", "eval.sets.m.reward.name=hub", "eval.sets.m.reward.params.workers=many"
    )


def test_validate_names_a_missing_eval_file(tmp_path, capsys):
    from relax.core.cli import main

    assert main(["validate", f"run_dir={tmp_path}", f"eval.sets.x.path={tmp_path / 'missing.jsonl'}"]) == 2
    assert "eval.sets.x.path" in capsys.readouterr().err
