"""Disk errors name the path and the cause; a failed checkpoint leaves nothing half-written.

Real OS errors only: a 256 KiB tmpfs (root), a read-only mount (or mode 0555 without root) and
RLIMIT_FSIZE in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from relax.core.checkpoint import CheckpointManager
from relax.core.disk import DiskError, disk_guard
from relax.core.metrics import MetricsLogger


def write_tensor(numel: int):
    def write(tmp):
        (tmp / "trainer").mkdir()
        torch.save({"w": torch.ones(numel)}, tmp / "trainer" / "state.pt")

    return write


def test_full_disk_during_checkpoint_names_path_and_cause_and_leaves_no_partial_dir(full_disk):
    manager = CheckpointManager(full_disk / "checkpoints")
    kept = manager.save(1, write_tensor(1000), {"step": 1})  # 4 KB: fits
    with pytest.raises(DiskError) as err:
        manager.save(2, write_tensor(1 << 18), {"step": 2})  # 1 MiB: does not
    message = str(err.value)
    assert "checkpoint step 2" in message and "no space left on device" in message
    assert str(full_disk / "checkpoints" / ".tmp-step_000002") in message
    assert "unexpected pos" in message  # torch's own words are kept after the cause
    assert manager.list() == [(1, kept)]
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_000001"]
    assert torch.load(kept / "trainer" / "state.pt")["w"].numel() == 1000  # the earlier one is intact


def test_resaving_a_step_on_a_full_disk_keeps_the_old_copy(full_disk):
    manager = CheckpointManager(full_disk / "checkpoints")
    manager.save(3, write_tensor(1000), {"step": 3})
    with pytest.raises(DiskError, match="no space left on device"):
        manager.save(3, write_tensor(1 << 18), {"step": 3})
    assert [p.name for p in manager.root.iterdir()] == ["step_000003"]
    assert torch.load(manager.latest() / "trainer" / "state.pt")["w"].numel() == 1000


def test_read_only_checkpoint_dir(readonly_dir):
    manager = CheckpointManager(readonly_dir / "checkpoints")
    with pytest.raises(DiskError) as err:
        manager.save(1, write_tensor(10), {"step": 1})
    assert str(readonly_dir / "checkpoints") in str(err.value)
    assert "read-only file system" in str(err.value) or "permission denied" in str(err.value)
    assert not (readonly_dir / "checkpoints").exists()


def test_file_size_limit_in_a_subprocess(tmp_path):
    """RLIMIT_FSIZE: torch.save fails with 'unexpected pos'; the error says the file got too large."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        from relax.core.checkpoint import CheckpointManager
        from relax.core.disk import DiskError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        manager = CheckpointManager({str(tmp_path / "ckpt")!r})
        try:
            manager.save(5, lambda tmp: torch.save(torch.ones(1 << 16), tmp / "big.pt"), {{}})
        except DiskError as e:
            print("DISKERROR", e)
            print("LEFT", sorted(p.name for p in Path({str(tmp_path / "ckpt")!r}).iterdir()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "DISKERROR checkpoint step 5: cannot write" in proc.stdout
    assert str(tmp_path / "ckpt" / ".tmp-step_000005") in proc.stdout
    assert "file too large" in proc.stdout and "RLIMIT_FSIZE is 65536 bytes" in proc.stdout
    assert "LEFT []" in proc.stdout


def fill(directory) -> None:
    """Write until the file system is full."""
    with open(directory / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


def test_metrics_write_on_a_full_disk(full_disk):
    logger = MetricsLogger(full_disk / "run", backends=())
    logger.log(1, {"reward/mean": 0.5})
    fill(full_disk)
    with pytest.raises(DiskError) as err:
        for step in range(2, 200):  # the page already allocated may take a few rows
            logger.log(step, {"reward/mean": 0.5, "pad": 1.0 * step})
    assert "metrics step" in str(err.value) and "no space left on device" in str(err.value)
    assert str(full_disk / "run" / "metrics.jsonl") in str(err.value)


def test_final_hf_save_on_a_full_disk(full_disk):
    """safetensors reports the OS error only in its text ('os error 28'); it is still recognised."""
    from safetensors.torch import save_file

    target = full_disk / "final_hf"
    target.mkdir()
    with pytest.raises(DiskError) as err, disk_guard("final HF save", target):
        save_file({"w": torch.ones(1 << 18)}, str(target / "model.safetensors"))
    assert f"final HF save: cannot write {str(target)!r}: no space left on device" in str(err.value)


def test_other_errors_pass_through_and_still_clean_up(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")

    def broken(tmp):
        (tmp / "partial").write_text("x")
        raise ValueError("trainer refused")

    with pytest.raises(ValueError, match="trainer refused"):
        manager.save(1, broken, {})
    assert list(manager.root.iterdir()) == []
