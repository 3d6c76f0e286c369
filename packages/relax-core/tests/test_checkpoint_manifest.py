"""Checkpoints are verified before a resume: a manifest (sizes + SHA-256) written last, the newest
valid checkpoint chosen by ``resume: auto``, and errors that name the checkpoint and the file.

Real files on disk, really truncated / overwritten; torch's own loader shows what a user saw before.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from relax.core.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    problems,
    read_controller_state,
    resolve_resume,
    verify,
)


def write_state(tmp):
    (tmp / "trainer").mkdir()
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp / "trainer" / "state.pt")


@pytest.fixture
def three(tmp_path):
    """Checkpoints at steps 1, 2 and 3 of one run."""
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=5)
    paths = [manager.save(step, write_state, {"step": step}) for step in (1, 2, 3)]
    return manager, paths


def truncate(path, keep: int = 100) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_save_writes_the_manifest_last_with_every_file(three):
    _, paths = three
    manifest = json.loads((paths[-1] / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["controller.json", "trainer/state.pt"]
    state = paths[-1] / "trainer" / "state.pt"
    assert manifest["files"]["trainer/state.pt"]["size"] == state.stat().st_size
    assert not list(paths[-1].glob(".*"))  # the manifest's temp file was renamed, not left behind
    assert verify(paths[-1]) == paths[-1] and problems(paths[-1]) == []


def test_a_failed_save_publishes_no_manifest_and_no_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")

    def fail(tmp):
        write_state(tmp)
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        manager.save(1, fail, {"step": 1})
    assert manager.list() == [] and not list((tmp_path / "checkpoints").iterdir())


def test_truncated_trainer_file_falls_back_to_the_previous_checkpoint_naming_what_was_skipped(three, caplog):
    manager, paths = three
    state = paths[-1] / "trainer" / "state.pt"
    truncate(state)
    with pytest.raises(RuntimeError, match="central directory"):  # what resuming from it used to say
        torch.load(state, weights_only=True)
    with caplog.at_level(logging.WARNING, logger="relax"):
        found = resolve_resume("auto", manager.root)
    assert found == paths[1]
    warning = caplog.text
    assert (
        f"skipped checkpoint {paths[-1]}" in warning and f"{state}: 100 bytes, the manifest says" in warning
    )
    assert "invalid-step_000003" in warning
    # moved aside (kept), so later saves' pruning can never delete the checkpoint the run resumed from
    assert (manager.root / "invalid-step_000003" / "trainer" / "state.pt").is_file()
    assert [p for _, p in manager.list()] == paths[:2]
    manager.keep_last = 1
    resumed_next = manager.save(3, write_state, {"step": 3})
    assert [p for _, p in manager.list()] == [resumed_next] and problems(resumed_next) == []


def test_same_size_corruption_is_caught_by_the_checksum(three):
    _, paths = three
    state = paths[-1] / "trainer" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert problems(paths[-1]) == [f"{state}: checksum mismatch (corrupt)"]
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {paths[-1]} is unusable: {state}: checksum mismatch"
    ):
        resolve_resume(str(paths[-1]), paths[-1].parent)  # an explicit path: verified, no fallback


def test_corrupt_controller_state_names_the_file_not_a_bare_json_error(three, caplog):
    manager, paths = three
    controller = paths[-1] / "controller.json"
    controller.write_text('{"step": 3, "vers')
    with pytest.raises(
        CheckpointError, match=rf"{controller}: unreadable controller state of checkpoint {paths[-1]}"
    ):
        read_controller_state(paths[-1])
    with caplog.at_level(logging.WARNING, logger="relax"):
        assert resolve_resume("auto", manager.root) == paths[1]
    assert f"{controller}: " in caplog.text


def test_missing_file_and_unreadable_manifest(three):
    _, paths = three
    (paths[0] / "trainer" / "state.pt").unlink()
    assert problems(paths[0]) == [f"{paths[0] / 'trainer' / 'state.pt'}: missing"]
    truncate(paths[1] / MANIFEST, keep=10)
    (bad,) = problems(paths[1])
    assert bad.startswith(f"{paths[1] / MANIFEST}: unreadable manifest")


def test_no_valid_checkpoint_is_an_error_that_says_how_to_start_over(three):
    manager, paths = three
    for path in paths:
        truncate(path / "trainer" / "state.pt")
    with pytest.raises(CheckpointError) as err:
        resolve_resume("auto", manager.root)
    message = str(err.value)
    assert all(p.name in message for p in paths) and "checkpoint.resume=never" in message
    assert [p for _, p in manager.list()] == paths  # nothing moved: the user decides
    assert resolve_resume("never", manager.root) is None


def test_a_checkpoint_of_an_older_relax_without_manifest_is_accepted_with_a_warning(three, caplog):
    manager, paths = three
    os.remove(paths[-1] / MANIFEST)
    with caplog.at_level(logging.WARNING, logger="relax"):
        assert resolve_resume("auto", manager.root) == paths[-1]
    assert f"checkpoint {paths[-1]} has no {MANIFEST} (written by an older Relax)" in caplog.text
    (paths[-1] / "controller.json").write_text("not json")  # ... but its controller state must still parse
    with caplog.at_level(logging.WARNING, logger="relax"):
        assert resolve_resume("auto", manager.root) == paths[1]
