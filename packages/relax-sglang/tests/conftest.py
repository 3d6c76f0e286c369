"""Fixtures for relax-sglang tests: the server environment (built from nothing when missing, reused when
present), one shared SGLang server per session on the kit's tiny Qwen3, and a megatron world for the tests
that sync the megatron trainer's weights into a server."""

from __future__ import annotations

import pytest

from relax.core.testing.models import MODEL_SEED, OTHER_MODEL_SEED, tiny_model_dir


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_shared_server: kills the session's SGLang server (runs last)")


def pytest_collection_modifyitems(session, config, items):
    """Tests that kill the session's one SGLang server run after every other test of the session, so the
    server is launched once (stable sort: the rest keep their order)."""
    items.sort(key=lambda item: item.get_closest_marker("kills_shared_server") is not None)


@pytest.fixture(scope="session")
def sglang_python(tmp_path_factory) -> str:
    """The server venv's interpreter; a failed build fails the test with the build log's tail (no skip)."""
    from relax.sglang.testing import ServerEnvError, server_python

    try:
        return server_python(tmp_path_factory.getbasetemp() / "sglang-server-env-build.log")
    except ServerEnvError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[str, str]:
    """(model, other model): the conformance kit's tiny Qwen3 pair (same paths as its fixtures)."""
    root = tmp_path_factory.getbasetemp()
    return tiny_model_dir(root, MODEL_SEED), tiny_model_dir(root, OTHER_MODEL_SEED)


@pytest.fixture(scope="session")
def sglang_engine(sglang_python, tiny_dirs, tmp_path_factory):
    """The session's one launched server, serving the tiny model (tests restore weights they change)."""
    from relax.sglang.testing import close_shared, shared_engine

    engine = shared_engine(tiny_dirs[0], str(tmp_path_factory.getbasetemp() / "sglang-run"))
    yield engine
    close_shared()


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """torch.distributed (gloo, world of one) + megatron's parallel state TP=1 PP=1, torn down after the
    module (as relax-megatron's own tests do), so the rest of the session sees an untouched torch. Skips
    the test where relax-megatron's megatron-core is not installed."""
    pytest.importorskip("megatron.core", reason="relax-megatron's megatron-core is not installed")
    from relax.megatron.parallel import world_of_one

    with world_of_one(str(tmp_path_factory.mktemp("megatron-gloo") / "store")):
        yield
