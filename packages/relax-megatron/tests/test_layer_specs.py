"""Transformer Engine is optional (layer_specs.py): which spec ``auto`` picks, the weight names in which
the TE spec differs from the local one, and the megatron-core version the GPU check prints. Building
the TE model needs CUDA and ``transformer_engine`` (built for this torch: docs/gpu.md): a GPU test."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from relax.megatron import convert
from relax.megatron.layer_specs import (
    from_te_names,
    megatron_core_version,
    resolve_layer_spec,
    to_te_names,
    transformer_engine_available,
    uses_te_names,
)

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def test_auto_takes_te_only_on_cuda_with_transformer_engine():
    assert resolve_layer_spec("auto", "cuda", te_available=True) == "te"
    assert resolve_layer_spec("auto", "cuda", te_available=False) == "local"
    assert resolve_layer_spec("auto", "cpu", te_available=True) == "local"
    assert resolve_layer_spec("local", "cuda", te_available=True) == "local"
    assert resolve_layer_spec("te", "cuda", te_available=True) == "te"
    with pytest.raises(
        ValueError, match=r"layer_spec: te needs Transformer Engine .*docs/gpu.md#transformer-engine"
    ):
        resolve_layer_spec("te", "cuda", te_available=False)
    with pytest.raises(ValueError, match="te needs device: cuda"):
        resolve_layer_spec("te", "cpu", te_available=True)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_layer_spec("fused", "cuda")
    if not HAVE_TE:  # this machine: no TE, so auto means the local spec
        assert not transformer_engine_available() and resolve_layer_spec("auto", "cuda") == "local"


@pytest.mark.parametrize("moe", [False, True])
def test_te_names_fuse_the_norms_into_the_next_linear_and_back(tiny_qwen3, tiny_qwen3_moe, moe):
    _, config, hf = tiny_qwen3_moe if moe else tiny_qwen3
    local = convert.to_stage(convert.hf_to_megatron(hf, config)[0], config, 1, 0)
    te = to_te_names(local, moe=moe)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.input_layernorm.weight" not in te
    # a dense MLP's norm goes into linear_fc1; an MoE layer keeps its own pre-MLP norm
    assert ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te) is not moe
    assert ("decoder.layers.1.pre_mlp_layernorm.weight" in te) is moe
    assert (
        "decoder.final_layernorm.weight" in te and "decoder.layers.0.self_attention.q_layernorm.weight" in te
    )
    assert uses_te_names(te) and not uses_te_names(local)
    back = from_te_names(te)
    assert sorted(back) == sorted(local)
    assert all(back[n] is local[n] for n in local)


def test_megatron_core_version_is_the_pinned_minor():
    from importlib.metadata import version

    from relax.megatron import megatron_core_version as exported_version

    assert megatron_core_version() == version("megatron-core") == exported_version()
    assert megatron_core_version().startswith("0.16.")  # the lock: 0.16.x, the newest with Python 3.11 wheels


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not HAVE_TE,
    reason="needs a CUDA GPU and Transformer Engine built for this torch (docs/gpu.md)",
)
def test_te_spec_logprobs_match_hf(cuda_world, tiny_qwen3):
    """The TE spec (fused norms + linears, TE attention with no mask tensor) scores like transformers,
    and its export maps back to the HF weights exactly."""
    from transformers import AutoTokenizer

    from relax.core.testing import make_batch, make_samples, torch_trainer
    from relax.core.testing.trainer import exported
    from relax.megatron.trainer import MegatronTrainer

    model_dir, _, hf = tiny_qwen3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    trainer = MegatronTrainer(model_dir, micro_batch_size=4, device="cuda", layer_spec="te", trainable=False)
    assert trainer.layer_spec == "te" and uses_te_names(convert.weights_only(trainer.model.state_dict()))
    torch.testing.assert_close(
        trainer.forward_logprobs(batch), torch_trainer(model_dir).forward_logprobs(batch), atol=1e-3, rtol=0
    )
    weights = exported(trainer)
    assert sorted(weights) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(weights[name].cpu(), tensor), name


def test_transformer_engine_is_no_dependency():
    """No ``te`` extra: PyPI's TE PyTorch binding (an sdist requiring the CUDA 12 core) cannot share the lock's
    CUDA 13 torch, so TE is the user's build (docs/gpu.md); without it ``auto`` takes the local spec."""
    import importlib.metadata as metadata

    meta = metadata.metadata("relax-megatron")
    assert not [r for r in meta.get_all("Requires-Dist") if r.startswith("transformer-engine")]
