"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a page left
out of the nav or a nav entry without a page fails CI, as the site's users would otherwise find out."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
    reason="mkdocs is not installed (it is in the workspace's dev group)",
)


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    mkdocs = str(Path(sys.executable).parent / "mkdocs")
    return subprocess.run(
        [mkdocs, "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )


def test_site_builds_strict(tmp_path):
    proc = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index", "getting-started", "config", "hookspecs", "benchmarks", "plugins", "architecture"):
        assert (tmp_path / "site" / page.replace("index", "") / "index.html").is_file(), page


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE))
    assert pages == listed, (
        f"not in the nav: {sorted(pages - listed)}; no such page: {sorted(listed - pages)}"
    )


def test_strict_build_fails_on_a_broken_link(tmp_path):
    # the check the site relies on must itself work: a copy of the site with one dead link fails
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "no-such-page.md" in proc.stdout + proc.stderr
