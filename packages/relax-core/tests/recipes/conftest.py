"""The toy recipe plugin (``toy_recipes.py``) as the process-wide plugin manager, for core's recipe tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from toy_recipes import install, toy_plugin  # noqa: E402


@pytest.fixture
def toy_recipes(monkeypatch):
    """Core and the toy recipe plugin, nothing else installed."""
    return install(monkeypatch, toy_plugin())
