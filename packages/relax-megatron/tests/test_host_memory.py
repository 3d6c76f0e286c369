"""``host_memory.built_unfilled``: a megatron model built with its weights on the meta device, then given
host storage, is the plain CPU build's model (names, shapes, megatron's tensor-parallel attributes); a
buffer that ``torch.empty`` made is not lost (the model is built again as is)."""

from __future__ import annotations

import functools

import torch


def test_an_unfilled_build_has_the_plain_builds_parameters_and_attributes(megatron_world, tiny_qwen3):
    from relax.megatron import gpt_model
    from relax.megatron.host_memory import built_unfilled
    from relax.megatron.rank_load import no_init

    _, config, _ = tiny_qwen3
    build = functools.partial(
        gpt_model.build_gpt_model,
        config,
        use_cpu_initialization=True,
        init_method=no_init,
        output_layer_init_method=no_init,
    )
    plain, unfilled = dict(build().named_parameters()), dict(built_unfilled(build).named_parameters())
    assert list(unfilled) == list(plain)
    for name, p in unfilled.items():
        assert p.device.type == "cpu" and p.shape == plain[name].shape and p.dtype == plain[name].dtype, name
        assert vars(p) == vars(plain[name]), name  # tensor_model_parallel, partition_dim, allreduce, ...
    assert any(vars(p).get("tensor_model_parallel") for p in unfilled.values())


def test_a_buffer_made_by_torch_empty_keeps_its_values():
    from relax.megatron.host_memory import built_unfilled

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 2))
            self.register_buffer("scale", torch.empty(3).fill_(2.0))

    model = built_unfilled(Module)
    assert torch.equal(model.scale, torch.full((3,), 2.0))
    assert model.weight.device.type == "cpu"
