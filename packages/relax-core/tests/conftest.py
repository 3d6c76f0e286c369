"""Shared fixtures for relax-core tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local(ray_session):
    """The session's one local Ray instance (the repo-root ``ray_session``; ``ray.init`` cannot run twice).

    Test modules that define actor classes must make Ray pickle them by value, since pytest's
    importlib mode gives test modules names worker processes cannot import:
    ``ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])``.
    """
    return ray_session


def _mount_tmpfs(path, options: str) -> bool:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def _umount(path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path):
    """A real 256 KiB tmpfs (needs root; skipped otherwise): writes past it fail with ENOSPC."""
    import os

    mnt = tmp_path / "small_fs"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "size=256k"):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    yield mnt
    _umount(mnt)


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory no write succeeds in: a read-only tmpfs as root (modes do not stop root), else mode 0555."""
    import os

    d = tmp_path / "readonly"
    if os.geteuid() == 0:
        if not _mount_tmpfs(d, "ro,size=64k"):
            pytest.skip("cannot mount a read-only tmpfs here")
        yield d
        _umount(d)
    else:
        d.mkdir()
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
