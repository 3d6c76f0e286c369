"""Fixtures of relax-rewards' tests: a plugin manager that also holds ``misbehave``."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def with_misbehave():
    """The process-wide plugin manager with ``relax.rewards.testing`` loaded (``misbehave``)."""
    from relax.core.plugins import get_plugin_manager

    old = os.environ.get("RELAX_PLUGINS")
    os.environ["RELAX_PLUGINS"] = ",".join(p for p in (old, "relax.rewards.testing") if p)
    yield get_plugin_manager(refresh=True)
    if old is None:
        os.environ.pop("RELAX_PLUGINS", None)
    else:
        os.environ["RELAX_PLUGINS"] = old
    get_plugin_manager(refresh=True)
