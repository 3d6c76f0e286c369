"""``relax run`` over a damaged checkpoint: the failure names the file and the checkpoint, and the
command it prints resumes (from the newest valid checkpoint), never restarting at step 0.

Real runs of the quick-start with every role in the driver (no Ray: seconds), through ``cli.main``.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import signal

import pytest

from relax.core import cli
from relax.core.checkpoint import CheckpointManager
from relax.core.config import load_config
from relax.core.controller.recovery import resume_point

ARGS = [
    "total_steps=2",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=4",
    "trainer.num_minibatches=1",
    "data.task_size=50",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=5",
    "rollout.host=driver",
]


@pytest.fixture
def keep_signals():
    """``cli`` ignores SIGINT/SIGTERM after a failure (its process is ending); this one is pytest."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_damaged_checkpoint_is_named_and_the_printed_command_resumes(tmp_path, capsys, caplog, keep_signals):
    run_dir = tmp_path / "run"
    assert cli.main(["run", *ARGS, f"run_dir={run_dir}", "checkpoint.resume=never"]) == 0
    step1, step2 = run_dir / "checkpoints" / "step_000001", run_dir / "checkpoints" / "step_000002"
    (state,) = (step2 / "trainer").glob("*.pt")
    state.write_bytes(state.read_bytes()[:100])  # truncated, as by a full disk or a copy cut short
    capsys.readouterr()

    # the config says resume: never elsewhere; here the user points at the damaged checkpoint
    assert cli.main(["run", *ARGS, f"run_dir={run_dir}", f"checkpoint.resume={step2}"]) == 1
    err = capsys.readouterr().err
    assert f"relax: stopped: CheckpointError: checkpoint {step2} is unusable: {state}: 100 bytes" in err, err
    assert "central directory" not in err
    printed = re.search(r"relax: resume from (\S+) with: (relax run .*)", err)
    assert printed and printed.group(1) == str(step1), err
    command = shlex.split(printed.group(2))
    assert "checkpoint.resume=auto" in command and not any(
        a.startswith(f"checkpoint.resume={step2}") for a in command
    )

    with caplog.at_level(logging.INFO, logger="relax"):
        assert cli.main(command[1:]) == 0  # exactly what was printed
    assert f"skipped checkpoint {step2}" in caplog.text and f"{state}: 100 bytes" in caplog.text
    assert f"resumed from {step1} at step 1" in caplog.text  # not step 0
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
    assert (run_dir / "checkpoints" / "invalid-step_000002" / "trainer" / state.name).is_file()


def test_a_failure_before_any_checkpoint_still_prints_a_resuming_command(tmp_path, capsys, keep_signals):
    """A run that fails before its first checkpoint: the printed command keeps the configured start
    (an explicit path), and a config saying ``resume: never`` becomes ``auto`` -- re-running it after
    checkpoints exist must continue, not restart at step 0 over the run directory."""
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    run_dir = tmp_path / "run"
    assert cli.main(["run", *ARGS, f"run_dir={run_dir}", f"checkpoint.resume={bad}"]) == 1
    err = capsys.readouterr().err
    assert f"{bad} is not a Relax checkpoint" in err
    command = shlex.split(
        re.search(r"no checkpoint to resume from; start again with: (relax run .*)", err).group(1)
    )
    assert f"checkpoint.resume={bad}" in command

    cfg = load_config(None, [*ARGS, f"run_dir={run_dir}", "checkpoint.resume=never"])
    assert resume_point(cfg, None) == (None, "checkpoint.resume=auto")
    manager = CheckpointManager(run_dir / "checkpoints")
    saved = manager.save(4, lambda tmp: None, {"step": 4})
    assert resume_point(cfg, None) == (
        str(saved),
        "checkpoint.resume=auto",
    )  # found on disk, not only on the error
    elsewhere = CheckpointManager(tmp_path / "other").save(7, lambda tmp: None, {"step": 7})
    assert resume_point(cfg, str(elsewhere)) == (str(elsewhere), f"checkpoint.resume={elsewhere}")


def test_an_older_checkpoint_without_manifest_that_fails_to_load_is_named(tmp_path, caplog):
    """No manifest (an older Relax): accepted with a warning, and if its trainer state is damaged the
    error names the checkpoint and the trainer's directory, with the loader's own reason."""
    from relax.core.checkpoint import MANIFEST, CheckpointError
    from relax.core.controller.run import run

    run_dir = tmp_path / "run"
    run(load_config(None, [*ARGS, "total_steps=1", f"run_dir={run_dir}", "checkpoint.resume=never"]))
    step1 = run_dir / "checkpoints" / "step_000001"
    (step1 / MANIFEST).unlink()
    (state,) = (step1 / "trainer").glob("*.pt")
    state.write_bytes(state.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="relax"), pytest.raises(CheckpointError) as err:
        run(load_config(None, [*ARGS, f"run_dir={run_dir}", "checkpoint.resume=auto"]))
    assert f"checkpoint {step1} has no {MANIFEST} (written by an older Relax)" in caplog.text
    assert str(err.value).startswith(f"checkpoint {step1}: the trainer could not load {step1 / 'trainer'} (")
