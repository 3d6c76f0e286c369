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
