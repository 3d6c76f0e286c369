"""Suite-wide test setup: offline, quiet Ray; one local Ray instance per pytest session."""

from __future__ import annotations

import os

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """A real local Ray instance shared by the whole session (``ray.init`` twice would raise)."""
    import ray

    if not ray.is_initialized():
        cache = tmp_path_factory.mktemp("relax-cache")
        os.environ.setdefault("RELAX_CACHE_DIR", str(cache))
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "HF_HUB_OFFLINE", "OMP_NUM_THREADS", "WANDB_MODE", "RELAX_CACHE_DIR")}},
        )
    yield ray
