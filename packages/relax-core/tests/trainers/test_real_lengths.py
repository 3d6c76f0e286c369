"""Real lengths on the torch trainer: chunked logprobs/entropy, packed rows, token-budget micro-batches
and activation recompute each give the values and the update of the plain padded path."""

import pytest
import torch

from relax.core.algorithms import entropy_from_logits, logprobs_from_logits
from relax.core.data import Sample, collate
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing.moe_models import tiny_moe_dir
from relax.core.testing.trainer import learning_metrics
from relax.core.trainers.token_stats import chunked_token_stats
from relax.core.trainers.torch_trainer import TorchTrainer

from .test_torch_trainer import assert_params_close, params, ppo_objective


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("text"), seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_moe_dir(tmp_path_factory.mktemp("moe"), seed=3)


def long_tailed(rows: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of 2-5 prompt and 1-4 response tokens, one row's response 8x longer (the long tail);
    two rows share each prompt (GRPO groups)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        prompt = torch.randint(
            4, 20, (2 + (i // 2) % 4,), generator=torch.Generator().manual_seed(i // 2)
        ).tolist()
        length = 32 if i == 3 else 1 + (i * 5) % 4
        samples.append(
            Sample(
                prompt_ids=prompt,
                group_id=i // 2,
                response_ids=torch.randint(4, 20, (length,), generator=gen).tolist(),
            )
        )
    batch = collate(samples, pad_id=0)
    batch["advantages"] = (
        torch.where(torch.arange(rows)[:, None] % 3 == 0, 1.0, -0.4) * batch["response_mask"]
    )
    return batch


def make(model_dir, **kw):
    # lr 1e-3 / eps 1e-4: float noise in a near-zero gradient moves a weight by at most ~lr * noise / eps
    kw = {
        "objective": ppo_objective,
        "lr": 1e-3,
        "eps": 1e-4,
        "micro_batch_size": 4,
        "num_minibatches": 2,
        **kw,
    }
    return TorchTrainer(model_dir, **kw)


def test_chunked_stats_equal_full_logits_values_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    tokens = torch.randint(0, 50, (37,))
    weights = torch.randn(2, 37)

    def grads(stats):
        (stats * weights).sum().backward()
        out = hidden.grad.clone(), head.weight.grad.clone()
        hidden.grad, head.weight.grad = None, None
        return out

    logits = head(hidden) / 0.7
    full = torch.stack([logprobs_from_logits(logits, tokens), entropy_from_logits(logits)])
    want = full.detach(), *grads(full)
    for chunk in (5, 16, 0):  # uneven chunks, and one chunk
        got = chunked_token_stats(head, hidden, tokens, temperature=0.7, chunk_tokens=chunk)
        torch.testing.assert_close(got.detach(), want[0], atol=1e-6, rtol=0)
        for g, w in zip(grads(got), want[1:], strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["text", "moe"])
def test_packed_logprobs_equal_the_padded_ones(family, text_dir, moe_dir):
    model_dir = text_dir if family == "text" else moe_dir
    batch = long_tailed()
    padded = make(model_dir, share_prompts=False).forward_logprobs(batch)
    packed = make(model_dir, pack_sequences=True, max_tokens_per_micro_batch=40).forward_logprobs(batch)
    assert padded.abs().sum() > 0
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def step(model_dir, batch, **kw):
    trainer = make(model_dir, **kw)
    metrics = trainer.train_step(dict(batch))
    return metrics, params(trainer)


@pytest.mark.parametrize(
    "variant",
    [
        {"max_tokens_per_micro_batch": 40},
        {"max_tokens_per_micro_batch": 40, "pack_sequences": True},
        {"pack_sequences": True, "logits_chunk_tokens": 7},
        {"recompute": "full", "logits_chunk_tokens": 3},
        {
            "recompute": "full",
            "pack_sequences": True,
            "max_tokens_per_micro_batch": 40,
            "logits_chunk_tokens": 5,
        },
    ],
)
def test_a_training_step_equals_the_fixed_row_padded_step(variant, text_dir):
    batch = long_tailed()
    want_metrics, want_params = step(text_dir, batch, logits_chunk_tokens=0)  # today's path: full logits
    got_metrics, got_params = step(text_dir, batch, **variant)
    for key, value in learning_metrics(want_metrics).items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert_params_close(got_params, want_params, atol=1e-5)


def test_token_budget_metrics_show_fewer_padded_positions(text_dir):
    batch = long_tailed()
    fixed, _ = step(text_dir, batch)
    budget, _ = step(text_dir, batch, max_tokens_per_micro_batch=40)
    packed, _ = step(text_dir, batch, max_tokens_per_micro_batch=40, pack_sequences=True)
    assert (
        fixed["perf/padding_frac"] > 0.5 > budget["perf/padding_frac"]
    )  # the long tail pads every fixed-row micro-batch
    assert packed["perf/padding_frac"] == 0.0
    assert fixed["perf/micro_batches"] == 2  # 5 rows per mini-batch, 4 per micro-batch
    assert packed["perf/peak_rss_gb"] > 0


def test_full_recompute_runs_each_block_twice_per_training_forward(text_dir):
    batch = long_tailed(rows=4)
    counts = {}
    for mode in ("off", "full"):
        trainer = make(text_dir, recompute=mode, num_minibatches=1, micro_batch_size=4)
        calls = []
        layers = trainer.model.model.layers
        for layer in layers:  # a submodule's hook: the recomputed forward calls the block's forward directly
            layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        batch_with_old = {**batch, "old_logprobs": trainer.forward_logprobs(batch)}
        calls.clear()
        trainer.train_step(batch_with_old)
        counts[mode] = len(calls)
    assert counts["off"] == len(layers) * 2  # prompt-shared forward: the prompts, then the responses
    assert counts["full"] == 2 * len(
        layers
    )  # one plain forward (recompute turns prompt sharing off), again in backward
    assert [len(make(text_dir, recompute=m).recomputed) for m in ("off", "full")] == [0, len(layers)]
    with pytest.raises(ValueError, match="trainer.recompute: 'selective'"):
        make(text_dir, recompute="selective")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
def test_on_cuda_packed_chunked_budget_logprobs_equal_padded_and_take_less_memory(text_dir):
    """On a GPU: packed rows (per-row causal SDPA, or the model's flash-attention varlen kernels), chunked
    logprobs and a token budget give the padded path's logprobs, and the step's allocator peak is lower."""
    batch = long_tailed(rows=16)
    kw = {"device": "cuda", "micro_batch_size": 16}
    padded = make(text_dir, logits_chunk_tokens=0, **kw)
    real = make(text_dir, pack_sequences=True, max_tokens_per_micro_batch=64, logits_chunk_tokens=8, **kw)
    torch.testing.assert_close(
        real.forward_logprobs(batch), padded.forward_logprobs(batch), atol=1e-4, rtol=0
    )
    peaks = [trainer.train_step(dict(batch))["perf/peak_mem_gb"] for trainer in (padded, real)]
    assert peaks[1] < peaks[0], peaks


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])  # Qwen3-VL: DeepStack features reach LM layers
def test_media_rows_run_packed_with_their_own_m_rope_positions(tmp_path, family):
    """Image, video and text rows packed into one sequence: each row's M-RoPE positions are the ones the
    model's rope index gives its padded row (``ModelAdapter.rope_positions``), the vision tower's attention
    (the packed implementation's too) stays bidirectional: logprobs and a training step equal the padded ones."""
    from relax.omni.tiny_models import tiny_multimodal_dir

    from .fsdp.test_fsdp_ranks import media_batch

    model_dir = tiny_multimodal_dir(tmp_path, family)
    batch = media_batch(model_dir, tmp_path)
    padded, packed = make(model_dir), make(model_dir, pack_sequences=True, max_tokens_per_micro_batch=4096)
    shapes = []
    packed.model.register_forward_pre_hook(
        lambda _, args, kw: shapes.append(tuple(kw["position_ids"].shape)), with_kwargs=True
    )
    want, got = padded.forward_logprobs(batch), packed.forward_logprobs(batch)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    real = int(batch["attention_mask"].sum())
    assert shapes == [(3, 1, real)]  # one packed forward, three rope axes per real token
    batch["old_logprobs"] = want
    ref, new = (
        learning_metrics(padded.train_step(dict(batch))),
        learning_metrics(packed.train_step(dict(batch))),
    )
    for key in ("loss", "entropy", "grad_norm"):
        assert new[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


def test_a_model_that_transforms_its_logits_keeps_the_full_logits_path():
    """Gemma-2 soft-caps its logits after the head: no pass-through head, stats from the model's own logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from relax.core.trainers.response_forward import ResponseLogits

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=24,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=2.0,
    )
    model = Gemma2ForCausalLM(config).eval()
    forward = ResponseLogits(model, share_prompts=False)
    assert forward.heads is None
    batch = long_tailed(rows=4)
    with torch.no_grad():
        stats = forward.stats(batch)
        logits = forward(batch)
    assert float(logits.abs().max()) <= 2.0  # capped
    torch.testing.assert_close(stats[0], logprobs_from_logits(logits, batch["responses"]), atol=1e-6, rtol=0)
