"""A real run through Ray (trainer and engine in their own actors, the disk transport without a
directory, so the trainer's sender makes a temporary one) leaves no weight directory behind: not
when it completes, not when it fails mid-way (here a plugin's ``relax_on_step_end`` raises at step 1).

The run may start its own Ray (the actors then get this test's ``TMPDIR``) or join the suite's (the
actors keep the temp dir they started with): the probe looks in both and counts only what is new."""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.timeout(900)

SMALL = [
    "total_steps=2",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=3",
    "data.task_size=40",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.save_every=0",
    "checkpoint.resume=never",
    "rollout.host=separate",
    "weight_sync.transport=disk",
]

PLUGIN = """
import glob
import os

SEEN = []


def weight_versions():
    roots = os.environ["CLOSE_TEST_ROOTS"].split(os.pathsep)
    return {path for root in roots for path in glob.glob(os.path.join(root, "relax-weights-*", "v*"))}


def relax_on_step_end(step, metrics):
    SEEN.append(weight_versions())
    if os.environ.get("CLOSE_TEST_FAIL_AT") == str(step):
        raise RuntimeError(f"failing on purpose at step {step}")
"""


@pytest.fixture
def run_env(tmp_path, monkeypatch):
    """A short TMPDIR of its own for the run's Ray and actors (Ray's socket paths must stay short),
    and the step-end probe loaded as a plugin in the driver (and importable by the actors)."""
    suite_tmp = tempfile.gettempdir()
    tmp = Path(tempfile.mkdtemp(prefix="rxc", dir="/tmp"))
    (tmp_path / "close_probe.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("RELAX_PLUGINS", "close_probe")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("CLOSE_TEST_ROOTS", os.pathsep.join([str(tmp), suite_tmp]))
    get_plugin_manager(refresh=True)
    import close_probe

    yield tmp, close_probe
    monkeypatch.delenv("RELAX_PLUGINS")
    get_plugin_manager(refresh=True)
    shutil.rmtree(tmp, ignore_errors=True)


def _weight_dirs() -> set[str]:
    return {
        str(p)
        for root in os.environ["CLOSE_TEST_ROOTS"].split(os.pathsep)
        for p in Path(root).glob("relax-weights-*")
    }


def test_the_transport_is_closed_when_the_run_completes_and_when_it_fails(run_env, tmp_path, monkeypatch):
    from relax.core.controller.run import run

    _, probe = run_env
    before_dirs, before_versions = _weight_dirs(), probe.weight_versions()
    run(load_config(None, [*SMALL, f"run_dir={tmp_path / 'ok'}"]))
    # the trainer's sender wrote a version dir each step ...
    assert [len(seen - before_versions) for seen in probe.SEEN] == [1, 2]
    assert _weight_dirs() == before_dirs  # ... and its close() removed the temporary directory

    probe.SEEN.clear()
    monkeypatch.setenv("CLOSE_TEST_FAIL_AT", "1")
    with pytest.raises(RuntimeError, match="failing on purpose at step 1"):
        run(load_config(None, [*SMALL, f"run_dir={tmp_path / 'failed'}"]))
    assert [len(seen - before_versions) for seen in probe.SEEN] == [1]
    assert _weight_dirs() == before_dirs
