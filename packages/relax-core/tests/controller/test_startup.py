"""Start-up: the driver's setup prepared in a thread equals the in-line one; its errors surface
when taken; the start-up line names every phase."""

from __future__ import annotations

import time

import pytest

from relax.core.config import load_config
from relax.core.controller.startup import BackgroundSetup, StartupClock, prepare_local, process_start_time
from relax.core.quickstart_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=1)


def test_background_setup_equals_the_inline_one_and_is_taken_once(model_dir, tmp_path):
    cfg = load_config(None, [f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}"])
    background = BackgroundSetup(cfg)
    inline = prepare_local(cfg)
    taken = background.take(cfg)
    assert taken.model_path == inline.model_path == model_dir
    assert (taken.pad_id, taken.stop_token_ids) == (
        inline.pad_id,
        inline.stop_token_ids,
    ) and taken.stop_token_ids
    assert [p.prompt_ids for p in taken.dataset.items[:5]] == [p.prompt_ids for p in inline.dataset.items[:5]]
    again = background.take(cfg)  # a restarted attempt prepares afresh
    assert again.dataset is not taken.dataset and again.model_path == model_dir


def test_background_error_is_raised_when_taken_naming_the_field(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path / 'missing'}", f"run_dir={tmp_path / 'run'}"])
    background = BackgroundSetup(cfg)
    with pytest.raises(FileNotFoundError, match=r"model\.path: .*missing.* is not a directory"):
        background.take(cfg)


def test_startup_line_names_each_phase_and_the_total():
    launched = process_start_time()
    assert launched is not None and launched <= time.time()
    clock = StartupClock(launched=time.time() - 1.0)
    clock.mark("python + imports")
    clock.add_overlapped("model, tokenizer, data", 0.25)
    clock.mark("roles")
    line = clock.summary()
    assert line.startswith("first step 1.") and "s after launch: python + imports 1.0 |" in line
    assert "model, tokenizer, data 0.2 (alongside) | roles 0.0" in line
    called = (
        StartupClock()
    )  # run() from a longer-lived process: from the call, the process's earlier work apart
    called.mark("roles")
    assert called.summary().startswith("first step 0.0 s after run(): roles 0.0")


def test_early_start_delivers_its_roles_error_once_and_keeps_the_ray_it_joined(ray_session, tmp_path):
    from relax.core.config import config_from_dict
    from relax.core.controller.startup import EarlyStart

    # built without the loader's path check, so the early thread's own error is what surfaces
    cfg = config_from_dict({**load_config(None).to_dict(), "model": {"path": str(tmp_path / "missing")}})
    early = EarlyStart(cfg)
    try:
        assert early.ray() is False  # Ray was already up: this start did not launch it
        with pytest.raises(FileNotFoundError, match="model.path"):
            early.take_roles()
        assert early.take_roles() is None  # a restarted attempt starts its own roles
    finally:
        early.release()


def test_ray_settings_are_peeked_from_the_file_and_overrides(tmp_path):
    """``relax run`` starts Ray from the ``ray:`` section alone, before the config loads."""
    from relax.core.controller.ray_start import RaySettings, default_num_cpus, peek_config

    def peek_settings(path, overrides):
        from relax.core.controller.ray_start import peek_settings

        return peek_settings(peek_config(path, overrides))

    assert peek_settings(None, []) == RaySettings(None, None, default_num_cpus())  # the bundled quick-start
    path = tmp_path / "cfg.yaml"
    path.write_text("ray:\n  num_cpus: 3\n  node_ip_address: 127.0.0.2\n")
    assert peek_settings(str(path), []) == RaySettings(None, "127.0.0.2", 3)
    assert peek_settings(str(path), ["ray.address=10.0.0.1:6379", "seed=3"]) == RaySettings(
        "10.0.0.1:6379", "127.0.0.2"
    )
    path.write_text("ray: [not, a, mapping]\n")
    assert peek_settings(str(path), []) is None  # unreadable: Ray starts after the loader said why
    assert peek_settings(str(tmp_path / "missing.yaml"), []) is None
    assert peek_settings(None, ["ray.num_cpus=zero"]) is None


def test_a_run_that_may_need_no_ray_does_not_start_one_before_its_config_loads():
    from relax.core.controller.ray_start import may_run_in_driver, peek_config

    assert may_run_in_driver(peek_config(None, []))  # the quick-start: colocate, rollout.host auto
    assert may_run_in_driver(peek_config(None, ["rollout.host=driver"]))
    for override in (
        "mode=async",
        "rollout.host=trainer",
        "rollout.host=separate",
        "ray.address=10.0.0.1:6379",
    ):
        assert not may_run_in_driver(peek_config(None, [override])), override


def test_the_loaded_config_decides_the_ray_it_needs(model_dir, tmp_path):
    """What ``EarlyStart`` compares its guess with: the config's own settings."""
    from relax.core.controller.ray_start import RaySettings, default_num_cpus
    from relax.core.controller.runtime import ray_settings

    cfg = load_config(None, [f"model.path={model_dir}", f"run_dir={tmp_path}"])
    assert ray_settings(cfg) == RaySettings(None, None, default_num_cpus())
    more = load_config(None, [f"model.path={model_dir}", f"run_dir={tmp_path}", "ray.num_cpus=64"])
    assert ray_settings(more) == RaySettings(None, None, 64)
