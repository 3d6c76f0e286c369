"""Run checkpoints: atomic (write to a temp dir, then rename), discoverable, pruned.

Layout: ``<run_dir>/checkpoints/step_000010/{trainer/, controller.json, ...}``. A directory only
gets its final name once everything inside is written, so a crash mid-save leaves at most a
``.tmp-*`` directory that is ignored (and cleaned) on the next save. A save that fails (a full
disk, a read-only directory) removes its temp directory at once and raises ``DiskError`` naming
the path and the cause.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.core.disk import disk_guard

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None], controller_state: dict[str, Any]) -> Path:
        """Call ``write(tmp_dir)`` to fill the checkpoint, then publish it atomically."""
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
                (tmp / "controller.json").write_text(json.dumps(controller_state, indent=1, sort_keys=True))
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
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / "controller.json").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1][1] if found else None

    def _prune(self) -> None:
        for _, path in self.list()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def read_controller_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "controller.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a Relax checkpoint (no controller.json)")
    return json.loads(path.read_text())


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """``auto`` -> latest checkpoint under root (or None); ``never`` -> None; else that directory."""
    if resume == "never":
        return None
    if resume == "auto":
        return CheckpointManager(root).latest()
    path = Path(resume)
    read_controller_state(path)  # validates
    return path
