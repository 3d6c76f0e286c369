"""One formatter and one line length for the whole repository, enforced here so CI fails on drift:
``ruff format`` and ``ruff check`` at the root's settings (line length 110), no ``# fmt: skip`` markers
(they were used to keep files under a size), and no Python file past 500 lines (split along a seam)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
SKIPPED_DIRS = {".venv", "site", "runs", "node_modules", ".git"}


def python_files() -> list[Path]:
    return [
        p
        for p in ROOT.rglob("*.py")
        if not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts) and "__pycache__" not in p.parts
    ]


def ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    if found.exists():
        return str(found)
    on_path = shutil.which("ruff")
    if on_path is None:
        pytest.fail("ruff is not installed: it is in the workspace's dev group (uv sync installs it)")
    return on_path


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_passes_on_the_whole_repository(args):
    done = subprocess.run([ruff(), *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"`ruff {' '.join(args)} .` failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )


def test_no_file_skips_the_formatter_or_grows_past_the_size_limit():
    files = python_files()
    assert len(files) > 100  # the scan sees the repository
    markers = [
        str(p.relative_to(ROOT))
        for p in files
        if "fmt: skip" in p.read_text() and p.name != Path(__file__).name
    ]
    too_long = {
        str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not markers, f"files with a formatter escape hatch: {markers}"
    assert not too_long, f"files past {MAX_LINES} lines (split them along a seam): {too_long}"
