"""Each CPU patch is still needed (megatron-core fails without it) and still works (the covered code runs
and gives the right answer with it). A megatron-core upgrade that fixes or moves a call site fails here."""

from __future__ import annotations

import pytest
import torch

from relax.megatron import cpu_compat

NO_CUDA = "Torch not compiled with CUDA enabled"


def probe_current_device():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(6)
    assert emb.shape == (6, 1, 1, 8) and emb.device.type == "cpu"
    assert torch.equal(emb[:, 0, 0, :4], emb[:, 0, 0, 4:])  # rotate-half layout: angles repeated


def probe_synchronize():
    from megatron.core.timers import Timer

    timer = Timer("probe")
    timer.start()
    timer.stop()
    assert timer.elapsed(reset=True) >= 0.0


def _tracker_with(seed: int):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("probe", seed)
    return tracker


def probe_torch_cuda_rng():
    before = torch.get_rng_state()
    tracker = _tracker_with(7)
    assert torch.equal(tracker.get_states()["probe"], torch.Generator().manual_seed(7).get_state())
    assert torch.equal(torch.get_rng_state(), before), "adding a tracker state must not move the default RNG"


def probe_megatron_rng_helpers():
    tracker = _tracker_with(7)
    before = torch.get_rng_state()
    with tracker.fork("probe"):
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(torch.get_rng_state(), before), "fork() must restore the default RNG"


def probe_schedules_cuda_tensors():
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from transformers import Qwen3Config

    from relax.megatron.gpt_model import build_gpt_model

    config = Qwen3Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=32,
    )
    model = build_gpt_model(config, perform_initialization=True)
    tokens = torch.arange(8)[None] % 16
    positions = torch.arange(8)[None]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch, positions, attention_mask=None, labels=batch)
        return losses, lambda out: (out.sum(), {"loss": out.sum().detach()})

    out = forward_backward_no_pipelining(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[model],
        num_microbatches=1,
        seq_length=8,
        micro_batch_size=1,
        forward_only=True,
    )
    with torch.no_grad():
        expected = model(tokens, positions, attention_mask=None, labels=tokens).sum()
    torch.testing.assert_close(out[0]["loss"], expected)


def probe_default_causal_mask():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, None)
    probs = softmax(torch.zeros(1, 1, 4, 4), None)
    expected = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5)[:, None]
    torch.testing.assert_close(probs[0, 0], expected)


def probe_moe_router_gemm():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    inp, weight = torch.randn(3, 8), torch.randn(4, 8)
    torch.testing.assert_close(router_gating_linear(inp, weight, None, torch.float32), inp @ weight.T)


#: patch -> (probe, what megatron raises without the patch)
PROBES = {
    "current_device": (probe_current_device, NO_CUDA),
    "synchronize": (probe_synchronize, NO_CUDA),
    "torch_cuda_rng": (probe_torch_cuda_rng, NO_CUDA),
    "megatron_rng_helpers": (probe_megatron_rng_helpers, NO_CUDA),
    "schedules_cuda_tensors": (probe_schedules_cuda_tensors, NO_CUDA),
    "default_causal_mask": (probe_default_causal_mask, NO_CUDA),
    "moe_router_gemm": (probe_moe_router_gemm, "te_general_gemm"),
}
#: patches whose code path needs several processes (PP > 1): probed through tp_worker.py
MULTI_PROCESS = ("tied_embedding_sync",)


def test_every_patch_has_a_probe():
    assert sorted([*PROBES, *MULTI_PROCESS]) == sorted(cpu_compat.PATCH_NAMES)
    with pytest.raises(ValueError, match="unknown cpu_compat patch"):
        cpu_compat.apply(["no_such_patch"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility patches apply only without a GPU")
@pytest.mark.parametrize("name", sorted(PROBES))
def test_patch_is_still_needed_and_still_works(megatron_world, name):
    probe, failure = PROBES[name]
    state = torch.get_rng_state()
    cpu_compat.remove()
    cpu_compat.apply([n for n in cpu_compat.PATCH_NAMES if n != name])
    try:
        with pytest.raises(Exception, match=failure):
            probe()
    finally:
        torch.set_rng_state(state)
        cpu_compat.apply()
    assert set(cpu_compat.active()) == set(cpu_compat.PATCH_NAMES)
    probe()


def test_remove_restores_torch(megatron_world):
    patched = torch.cuda.synchronize
    cpu_compat.remove(["synchronize"])
    try:
        assert torch.cuda.synchronize is not patched
        assert "synchronize" not in cpu_compat.active()
    finally:
        cpu_compat.apply()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility patches apply only without a GPU")
def test_tied_embedding_sync_is_still_needed(tiny_qwen3, run_ranks):
    """PP=2 with tied embeddings fails to build without the patch; that it works is
    test_tensor_parallel.py::test_pp2_logprobs_match_hf."""
    model_dir, _, _ = tiny_qwen3
    logs = run_ranks(
        "pipeline",
        model_dir,
        {"tokens": torch.zeros(1, 4, dtype=torch.long)},
        "--without",
        "tied_embedding_sync",
        expect_ok=False,
    )
    assert NO_CUDA in logs and "setup_embeddings_and_output_layer" in logs


def test_the_router_patch_follows_transformer_engine_not_the_gpu():
    """Every patch without a GPU; with one, the MoE router's whenever megatron found no TE GEMM (a GPU
    host without Transformer Engine would otherwise hit the NameError in Qwen3-MoE); none with TE."""
    assert cpu_compat.patches_needed(cuda_available=False, router_gemm_bound=True) == cpu_compat.PATCH_NAMES
    assert cpu_compat.patches_needed(cuda_available=True, router_gemm_bound=False) == ("moe_router_gemm",)
    assert cpu_compat.patches_needed(cuda_available=True, router_gemm_bound=True) == ()
    assert set(cpu_compat.WITHOUT_TE) <= set(cpu_compat.PATCH_NAMES)


def test_megatron_here_has_no_te_gemm(megatron_world):
    """This environment has no Transformer Engine: megatron left the router's GEMM unbound, so a GPU
    host with the same packages gets the router patch (the patch binding it does not count)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    assert "moe_router_gemm" in cpu_compat.active()  # applied by the world's initialisation
    assert cpu_compat.router_gemm_bound() is False
    cpu_compat.remove(["moe_router_gemm"])
    try:
        assert cpu_compat.router_gemm_bound() is False
    finally:
        cpu_compat.apply(["moe_router_gemm"])
