"""parallel.py: the model's layout/precision config fields (PP x distributed optimizer built one dict
with ``calculate_per_token_loss`` twice: a TypeError at construction) and process-group timeouts that
follow the configured one (not a fixed 120 s)."""

from __future__ import annotations

import pytest
import torch

from relax.megatron.parallel import model_overrides, timeout_minutes


def test_pipeline_and_distributed_optimizer_give_one_config(tiny_qwen3):
    from relax.megatron.gpt_model import transformer_config

    both = model_overrides(2, 1, torch.bfloat16, per_token_loss=True)
    assert both == {
        "pipeline_model_parallel_size": 2,
        "pipeline_dtype": torch.bfloat16,
        "calculate_per_token_loss": True,
        "params_dtype": torch.bfloat16,
        "bf16": True,
    }
    config = transformer_config(tiny_qwen3[1], **both)  # what the trainer builds: no duplicate keyword
    assert config.calculate_per_token_loss and config.pipeline_model_parallel_size == 2 and config.bf16
    assert model_overrides(1, 1, torch.float32, per_token_loss=False) == {}
    assert model_overrides(1, 2, torch.float32, per_token_loss=True) == {
        "calculate_per_token_loss": True,
        "expert_model_parallel_size": 2,
    }


def test_process_groups_wait_the_configured_timeout(tmp_path):
    """The default group and megatron's groups take the trainer's timeout (megatron in whole minutes)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax.megatron import cpu_compat
    from relax.megatron.parallel import ensure_process_group, initialize_model_parallel

    assert timeout_minutes(345) == 6 and timeout_minutes(1) == 1
    if dist.is_initialized():
        pytest.fail("a process group is left over from another test module: its fixture did not tear down")
    cpu = torch.device("cpu")
    ensure_process_group(0, 1, timeout_s=345)
    try:
        initialize_model_parallel(1, 1, timeout_s=345)
        default = dist.distributed_c10d._get_default_group()
        assert default._get_backend(cpu).options._timeout.total_seconds() == 345
        tp_group = parallel_state.get_tensor_model_parallel_group()
        assert tp_group._get_backend(cpu).options._timeout.total_seconds() == 6 * 60
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.remove()
