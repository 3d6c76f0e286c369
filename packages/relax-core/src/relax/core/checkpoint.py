"""Run checkpoints: atomic (write to a temp dir, then rename), verified, discoverable, pruned.

Layout: ``<run_dir>/checkpoints/step_000010/{trainer/, controller.json, manifest.json}``. A directory
only gets its final name once everything inside is written, so a crash mid-save leaves at most a
``.tmp-*`` directory that is ignored (and cleaned) on the next save. A save that fails (a full
disk, a read-only directory) removes its temp directory at once and raises ``DiskError`` naming
the path and the cause.

``manifest.json`` is written last (itself through a temp file and a rename): the size and SHA-256
of every other file. A checkpoint is verified against it before anything loads from it, so a
truncated or corrupt file is reported as that file of that checkpoint (``CheckpointError``), never
as torch's "failed finding central directory" or a bare ``JSONDecodeError``; ``resume: auto``
falls back to the newest checkpoint that verifies, warns naming each one it skipped and why, and
moves the skipped ones aside (``invalid-step_*``, kept for inspection, never pruned) so that the
pruning of later saves cannot delete the checkpoint the run resumed from.

Checkpoints written before manifests existed (no ``manifest.json``) are accepted with a warning:
their ``controller.json`` must parse, the rest is checked by the trainer's own load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.core.disk import disk_guard

log = logging.getLogger("relax")

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
CONTROLLER_STATE = "controller.json"
INVALID_PREFIX = "invalid-"
_MANIFEST_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the file."""


# ---------------------------------------------------------------------------- manifest


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[Path]:
    skip = {directory / MANIFEST, directory / f".{MANIFEST}.tmp"}
    return sorted(p for p in directory.rglob("*") if p.is_file() and p not in skip)


def write_manifest(directory: str | Path) -> Path:
    """Record the size and SHA-256 of every file under ``directory``; atomic (temp file + rename)."""
    directory = Path(directory)
    files = {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(directory)
    }
    tmp = directory / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST)
    return directory / MANIFEST


def problems(checkpoint_dir: str | Path) -> list[str]:
    """Why ``checkpoint_dir`` cannot be resumed from, one line per bad file ([] when it verifies).
    A checkpoint without a manifest (an older Relax) only needs a readable ``controller.json``."""
    directory = Path(checkpoint_dir)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        try:
            read_controller_state(directory)
        except (CheckpointError, FileNotFoundError) as exc:
            return [str(exc)]
        return []
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest_path}: unreadable manifest ({type(exc).__name__}: {exc})"]
    found = []
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            found.append(f"{path}: missing")
        elif (size := path.stat().st_size) != expected["size"]:
            found.append(
                f"{path}: {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
            )
        elif _sha256(path) != expected["sha256"]:
            found.append(f"{path}: checksum mismatch (corrupt)")
    return found


def verify(checkpoint_dir: str | Path) -> Path:
    """``checkpoint_dir`` if it verifies, else ``CheckpointError`` naming it and every bad file."""
    path = Path(checkpoint_dir)
    if bad := problems(path):
        raise CheckpointError(f"checkpoint {path} is unusable: " + "; ".join(bad))
    if not (path / MANIFEST).is_file():
        log.warning(
            "relax: checkpoint %s has no %s (written by an older Relax): its files are not verified",
            path,
            MANIFEST,
        )
    return path


def read_controller_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / CONTROLLER_STATE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a Relax checkpoint (no {CONTROLLER_STATE})")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: unreadable controller state of checkpoint {checkpoint_dir} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path}: not a controller state (no 'step') in checkpoint {checkpoint_dir}")
    return state


# ---------------------------------------------------------------------------- manager


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None], controller_state: dict[str, Any]) -> Path:
        """Call ``write(tmp_dir)`` to fill the checkpoint, add the controller state and, last, the
        manifest; then publish it atomically."""
        tmp = self.root / f".tmp-step_{step:06d}"
        final = self.root / f"step_{step:06d}"
        old = self.root / f".tmp-old-step_{step:06d}"
        try:
            with disk_guard(f"checkpoint step {step}", tmp):
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
                write(tmp)
                (tmp / CONTROLLER_STATE).write_text(json.dumps(controller_state, indent=1, sort_keys=True))
                write_manifest(tmp)
                if final.exists():  # a re-saved step: the old copy stays until the new one is in place
                    final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written checkpoint behind
            if old.exists() and not final.exists():
                old.rename(final)
            raise
        self._prune()
        return final

    def list(self) -> list[tuple[int, Path]]:
        """Every published checkpoint, oldest first (unverified: see :meth:`latest_valid`)."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / CONTROLLER_STATE).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1][1] if found else None

    def latest_valid(self) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
        """The newest checkpoint that verifies, and the newer ones skipped with their problems."""
        skipped = []
        for step_dir in self._step_dirs()[::-1]:
            if bad := problems(step_dir):
                skipped.append((step_dir, bad))
            else:
                return step_dir, skipped
        return None, skipped

    def _step_dirs(self) -> list[Path]:
        """Every ``step_*`` directory, also one that lost its controller state (corrupt)."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), c) for c in self.root.iterdir() if (m := _STEP_DIR.match(c.name)) and c.is_dir()
        ]
        return [path for _, path in sorted(found)]

    def set_aside(self, step_dir: Path) -> Path:
        """Rename an unusable checkpoint out of the way (kept for inspection, never pruned or resumed)."""
        target = step_dir.with_name(INVALID_PREFIX + step_dir.name)
        n = 1
        while target.exists():
            target, n = step_dir.with_name(f"{INVALID_PREFIX}{step_dir.name}.{n}"), n + 1
        step_dir.rename(target)
        return target

    def _prune(self) -> None:
        for _, path in self.list()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """``auto`` -> the newest checkpoint under root that verifies (None when there is none; an error
    when there are checkpoints but none verifies); ``never`` -> None; else that directory, verified."""
    if resume == "never":
        return None
    if resume != "auto":
        return verify(resume)
    manager = CheckpointManager(root)
    found, skipped = manager.latest_valid()
    if skipped and found is None:
        listing = "; ".join(f"{path.name}: {', '.join(bad)}" for path, bad in skipped)
        raise CheckpointError(
            f"checkpoint.resume=auto: no usable checkpoint under {root} ({listing}). To start this run again "
            "from step 0 (its metrics and checkpoints are overwritten), pass checkpoint.resume=never"
        )
    for path, bad in skipped:
        aside = manager.set_aside(path)
        log.warning(
            "relax: skipped checkpoint %s (%s); moved to %s; resuming from %s",
            path,
            "; ".join(bad),
            aside.name,
            found,
        )
    if found is not None and not (found / MANIFEST).is_file():
        verify(found)  # logs that an older Relax's checkpoint is not verified
    return found
