"""The memory plan's terms against what a real train step on CPU holds, for the terms a CPU can see.

Measured, not modelled: the tensors autograd saves for backward (``saved_tensors_hooks``, each storage once,
parameters excluded) -- exactly what the activation term estimates -- and the bytes of the parameters,
gradients and AdamW state after a real optimizer step. RSS is not used: on CPU it also holds the allocator's
cache and library heaps and moves from run to run; the saved-tensor sum is deterministic.

Tolerance: the activation count (docs/memory-plan.md) names the large tensors of a decoder layer and leaves out
small ones (rotary tables, norm statistics); it comes out within 5 % of the measurement without recompute and
11 % with it on these models, so the test allows 0.85-1.15. A term left out or counted twice (the MLP's
4 x intermediate, eager attention's S x S probabilities, the fp32 norm inputs of a bf16 model) moves the ratio
by more than 25 %, which the band catches. Parameter counts and optimizer state are exact.
"""

from __future__ import annotations

import pytest
import torch

from relax.core.memory_plan import shape_from_config
from relax.core.memory_plan.layout import TrainLayout, replicated
from relax.core.memory_plan.terms import activation_terms, state_terms

ROWS, ROW = 2, 256


def build(moe: bool, attn: str, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**common, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
        return config, Qwen3MoeForCausalLM(config).to(dtype)
    config = Qwen3Config(**common)
    return config, Qwen3ForCausalLM(config).to(dtype)


def saved_for_backward(model, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward in the decoder's forward (not the weights)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return x

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_term_matches_saved_tensors(moe, attn, dtype):
    config, model = build(moe, attn, dtype)
    shape = shape_from_config(config.to_dict())
    assert shape.total_params() == sum(
        p.numel() for p in model.parameters()
    )  # exact, experts and norms included
    ids = torch.randint(0, 512, (ROWS, ROW), generator=torch.Generator().manual_seed(0))
    layout = TrainLayout(world=1, flash_attention=attn == "sdpa")  # SDPA on CPU keeps no S x S tensor
    nbytes = 4 if dtype == torch.float32 else 2
    estimate = activation_terms(shape, layout, ROWS * ROW, ROW, nbytes, "off")["activations"]
    measured = saved_for_backward(model, ids)
    assert 0.85 <= estimate / measured <= 1.15, (estimate, measured)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kept = activation_terms(shape, layout, ROWS * ROW, ROW, nbytes, "full")[
        "activations (layer inputs, recompute)"
    ]
    measured_kept = saved_for_backward(model, ids)
    assert 0.85 <= kept / measured_kept <= 1.15, (kept, measured_kept)
    assert measured_kept < measured / 5  # what recompute is for


def test_eager_attention_term_is_what_sdpa_does_not_keep():
    """The S x S probabilities: the difference eager - sdpa measured equals the term's difference within 15 %."""
    _, eager = build(False, "eager", torch.float32)
    config, sdpa = build(False, "sdpa", torch.float32)
    shape = shape_from_config(config.to_dict())
    ids = torch.randint(0, 512, (ROWS, ROW), generator=torch.Generator().manual_seed(0))
    measured = saved_for_backward(eager, ids) - saved_for_backward(sdpa, ids)
    terms = [
        activation_terms(shape, TrainLayout(world=1, flash_attention=flash), ROWS * ROW, ROW, 4, "off")
        for flash in (False, True)
    ]
    estimate = terms[0]["activations"] - terms[1]["activations"]
    assert 0.85 <= estimate / measured <= 1.15, (estimate, measured)


def test_state_term_is_the_bytes_after_a_real_adamw_step():
    """The torch trainer's fp32 layout (parameters = masters, fp32 grads, AdamW moments) against a real step of
    core's optimizer: 16 bytes per parameter, exactly (AdamW's per-tensor step counters aside)."""
    from relax.core.trainers.optim import adamw

    config, model = build(False, "sdpa", torch.float32)
    shape = shape_from_config(config.to_dict())
    optimizer = adamw(list(model.parameters()), torch.device("cpu"), lr=1e-3)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = {id(p): p for p in model.parameters()}.values()
    held = {
        "weights": 0,
        "fp32 masters": sum(p.nbytes for p in params),
        "gradients": sum(p.grad.nbytes for p in params),
        "optimizer (AdamW)": sum(
            v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step"
        ),
    }
    estimate = state_terms(shape, replicated(1, "float32", autocast=True), 4)
    assert estimate == {k: float(v) for k, v in held.items()}
