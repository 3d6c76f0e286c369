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


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with the suite's torch thread count (OMP_NUM_THREADS above, 1). A run whose roles live
    in the driver (``rollout.host: driver``) sets the driver process's torch threads and OMP_NUM_THREADS to
    every core (roles._limit_threads) and leaves them so: later tests then summed in another order, and
    test_omni.py's megatron-vs-transformers logprobs came out 1.03e-5 apart (1e-5 allowed) only in a full run."""
    import sys

    before = os.environ.get("OMP_NUM_THREADS")
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before
    torch = sys.modules.get("torch")  # never imported here: tests that do not use torch stay free of it
    if torch is not None and before and before.isdigit() and torch.get_num_threads() != int(before):
        torch.set_num_threads(int(before))
