"""One in-process gloo world of size 1 with megatron's parallel state (TP=1, PP=1) per test module.

Module-scoped, not package-scoped: without an ``__init__.py`` pytest would keep a "package" fixture for the
whole session. Torn down (process group destroyed, CPU patches removed) after each module, so the rest of
a full pytest run sees an untouched torch.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # without it a megatron step is ~25x slower on CPU


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """``torch.distributed`` (gloo, world size 1) + megatron parallel state, TP=1, PP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax.megatron import cpu_compat
    from relax.megatron.parallel import initialize_model_parallel

    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        initialize_model_parallel(tensor_parallel=1, pipeline_parallel=1, seed=1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.remove()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(model_dir, HF config, HF state dict) of the conformance kit's tiny Qwen3 (built locally)."""
    from transformers import AutoConfig

    from relax.core.testing.models import load_hf_weights, tiny_model_dir

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("models"))
    return model_dir, AutoConfig.from_pretrained(model_dir), load_hf_weights(model_dir)
