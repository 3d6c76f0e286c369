"""Any causal LM transformers loads runs on core's generic path, no adapter needed: tiny Llama, GLM-4,
Gemma 3 (text; sliding-window layers beside full ones) and a Mistral-style all-sliding-window model, built
locally beside the quick-start tokenizer. Full-attention caches decode with continuous batching; the
sliding-window ones in static batches (their cache cannot be cut row by row). Both agree with the trainer's
logprobs, and the quick-start trains on each (colocate, every role in the driver, as ``relax run`` does)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import build_tokenizer
from relax.core.testing.models import run_async
from relax.core.testing.trainer import torch_trainer

pytestmark = pytest.mark.timeout(600)
WINDOW = 6  # shorter than every quick-start prompt: the window really drops positions
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
FAMILIES = {  # name: (config class, extra fields, continuous batching)
    "llama": ("LlamaConfig", {}, True),
    "glm4": ("Glm4Config", {}, True),
    "gemma3_text": (
        "Gemma3TextConfig",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        False,
    ),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}, False),
}


def build_family(directory: Path, family: str, seed: int = 0) -> str:
    """A seeded tiny ``family`` causal LM with the quick-start tokenizer, saved as an HF directory."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    cls, extra, _ = FAMILIES[family]
    tokenizer = build_tokenizer()
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    config = getattr(transformers, cls)(
        vocab_size=len(tokenizer), tie_word_embeddings=False, **SIZES, **ids, **extra
    )
    assert config.model_type == family
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # fresh norms are all ones (or zeros): noise makes every weight count
            p.data.add_(0.05 * torch.randn_like(p))
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, build_family(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_decodes_every_family_as_the_trainer_scores_it(family_dir, caplog):
    """Prompts of different lengths (all longer than the window), a group of two sharing one prompt and a
    resumed prefix, decoded together: every token's logprob equals the trainer's forward."""
    family, model_dir = family_dir
    with caplog.at_level(logging.INFO, logger="relax.core.engines.hf"):
        engine = HFRolloutEngine(model_dir, max_batch_size=3)  # 4 requests: a second batch joins later
    continuous = FAMILIES[family][2]
    assert engine.continuous_batching is continuous
    assert ("static batches" in caplog.text) is not continuous  # one log line when it falls back
    tok = engine.tokenizer
    prompts = [tok.encode("12+3=?"), tok.encode("7*8-2= ?"), tok.encode("12+3=?"), tok.encode("9-4=")]
    params = [SamplingParams(max_new_tokens=8, seed=i, ignore_eos=i % 2 == 0) for i in range(len(prompts))]
    requests = [GenerationRequest(str(i), p, params[i]) for i, p in enumerate(prompts)]
    requests[3] = GenerationRequest(
        "3",
        prompts[3],
        params[3],
        prefix_response_ids=tok.encode("5 "),
        prefix_logprobs=[0.0, 0.0],
        prefix_versions=[0, 0],
    )
    results = run_async(engine.generate(requests), 120)
    assert all(r.finish_reason in ("stop", "length") and r.response_ids for r in results)
    assert len(results[0].response_ids) == 8  # ignore_eos: the full budget, well past the window
    samples = [
        Sample(prompt_ids=p, group_id=i, response_ids=r.response_ids)
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    batch = collate(samples, engine.pad_token_id)
    trained = torch_trainer(model_dir).forward_logprobs(batch)
    for i, r in enumerate(results):
        start = 2 if i == 3 else 0  # the resumed prefix's logprobs are the caller's
        got = torch.tensor(r.logprobs[start:])
        want = trained[i, start : len(r.response_ids)]
        assert (got - want).abs().max() <= 1e-4, (family, i, (got - want).abs().max())


def test_static_batches_rescore_after_a_weight_update(tmp_path):
    """A weight update while a static batch decodes: its prefill re-runs with the new weights, so the tokens
    after it carry the new version and the new weights' logprobs."""
    import asyncio

    model_dir = build_family(tmp_path, "gemma3_text")
    engine = HFRolloutEngine(model_dir)
    prompt = engine.tokenizer.encode("12+3=?")
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in engine.model.state_dict().items()}
    request = GenerationRequest("w", prompt, SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True))

    async def scenario():
        task = asyncio.ensure_future(engine.generate([request]))
        while engine.stats["decode_rows"] < 3:
            await asyncio.sleep(0)
        engine.update_weights(new, version=1)
        return (await asyncio.wait_for(task, 60))[0]

    result = asyncio.run(scenario())
    assert result.versions == [0, 0, 0, 1, 1, 1]
    ids = torch.tensor([prompt + result.response_ids])
    with torch.no_grad():
        lps = torch.log_softmax(engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
    want = lps.gather(-1, torch.tensor(result.response_ids)[:, None]).squeeze(-1)[3:]
    assert (want - torch.tensor(result.logprobs[3:])).abs().max() <= 1e-5


SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "trainer.micro_batch_size=8",
    "data.task_size=50",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]


def test_the_quickstart_trains_every_family(family_dir, tmp_path):
    """``relax run`` with ``model.path`` at the family's directory: the steps complete, the metrics are finite
    and the engine's logprobs agree with the trainer's."""
    from relax.core.config import load_config
    from relax.core.controller.run import run

    family, model_dir = family_dir
    cfg = load_config(
        None,
        [*SMALL, f"model.path={model_dir}", "rollout.host=driver", "total_steps=2", f"run_dir={tmp_path}"],
    )
    assert run(cfg)["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("train/loss", "train/grad_norm", "reward/mean", "response/length_mean"):
            assert math.isfinite(row[key]), (family, key, row[key])
        assert row["rollout/train_logprob_abs_diff"] < 1e-3, (family, row["rollout/train_logprob_abs_diff"])


def test_static_batches_pause_and_abort_at_token_boundaries(tmp_path):
    """The static path honours pause (no token while paused) and abort (rows end "abort" with their tokens)."""
    import asyncio

    engine = HFRolloutEngine(
        build_family(tmp_path, "mistral"), max_batch_size=1
    )  # two batches, one after the other
    prompt = engine.tokenizer.encode("12+3=?")
    requests = [
        GenerationRequest(str(i), prompt, SamplingParams(max_new_tokens=50, seed=i, ignore_eos=True))
        for i in range(2)
    ]

    async def scenario():
        task = asyncio.ensure_future(engine.generate(requests))
        while engine.stats["decode_rows"] < 3:
            await asyncio.sleep(0)
        engine.pause()
        paused_at = engine.stats["decode_rows"]
        await asyncio.sleep(0.1)
        assert engine.stats["decode_rows"] == paused_at and engine.health()["in_flight"] == 1
        engine.abort()
        engine.resume()
        return await asyncio.wait_for(task, 60)

    first, second = asyncio.run(scenario())
    assert first.finish_reason == second.finish_reason == "abort"
    assert 3 <= len(first.response_ids) < 50 and second.response_ids == []
    assert len(first.logprobs) == len(first.versions) == len(first.response_ids)
    assert engine.health()["in_flight"] == 0
