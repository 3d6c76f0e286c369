import asyncio

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, RolloutEngine, SamplingParams
from relax.core.quickstart_model import build_tiny_model

# prompts of different lengths exercise left padding; ids avoid the special tokens 0-3
PROMPTS = [[1, 4, 23, 10, 17, 11, 20, 2, 23, 1, 5, 23], [10, 17, 11, 20], [12, 18, 9, 20, 5, 23], [7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a larger init scale than the quick-start's makes the distributions far from uniform
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


@pytest.fixture
def engine(model_dir):
    return HFRolloutEngine(model_dir)


def run(engine, prompts, **params):
    reqs = [GenerationRequest(str(i), p, SamplingParams(**params)) for i, p in enumerate(prompts)]
    return asyncio.run(engine.generate(reqs))


def greedy_reference(model, prompt, steps):
    """Argmax continuation recomputed without KV cache or padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.health()["ok"] and engine.weight_version() == 0


def test_greedy_and_top_k_one_are_argmax(engine):
    eos = engine.eos_token_ids
    greedy = run(engine, PROMPTS, temperature=0.0, max_new_tokens=6, stop_token_ids=())
    top1 = run(engine, PROMPTS, temperature=1.0, top_k=1, max_new_tokens=6, seed=5)
    for prompt, g, t in zip(PROMPTS, greedy, top1, strict=True):
        ref = greedy_reference(engine.model, prompt, 6)
        cut = next((i + 1 for i, tok in enumerate(ref) if tok in eos), len(ref))
        assert g.response_ids == ref[:cut] == t.response_ids
        assert all(lp == 0.0 for lp in t.logprobs)  # one-token distribution
        assert all(lp < 0.0 for lp in g.logprobs)  # greedy reports the plain softmax


def test_stop_ids_stop_strings_and_length(engine):
    prompt = PROMPTS[0]

    # a seed whose 12-token sample has no special tokens (ids 0-3) in its first six
    def plain(ids):
        return len(ids) == 6 and min(ids) > 3

    seed = next(
        s for s in range(100) if plain(run(engine, [prompt], max_new_tokens=6, seed=s)[0].response_ids)
    )
    free = run(engine, [prompt], temperature=1.0, max_new_tokens=12, seed=seed)[0]
    ids = free.response_ids
    first = ids.index(ids[2])
    by_id = run(engine, [prompt], temperature=1.0, max_new_tokens=12, seed=seed, stop_token_ids=(ids[2],))[0]
    assert by_id.response_ids == ids[: first + 1] and by_id.finish_reason == "stop"
    stop_text = engine.tokenizer.decode(ids[1:3])
    by_str = run(engine, [prompt], temperature=1.0, max_new_tokens=12, seed=seed, stop=(stop_text,))[0]
    end = next(i for i in range(1, len(ids) + 1) if stop_text in engine.tokenizer.decode(ids[:i]))
    assert by_str.response_ids == ids[:end] and by_str.finish_reason == "stop"
    assert stop_text in by_str.text
    short = run(engine, [prompt], temperature=1.0, max_new_tokens=3, seed=seed)[0]
    assert short.response_ids == ids[:3] and short.finish_reason == "length"
    assert len(short.logprobs) == len(short.versions) == 3


def test_eos_ends_generation(engine):
    results = run(engine, PROMPTS * 8, temperature=1.0, max_new_tokens=16)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped, "some of 32 samples of 16 tokens hit an EOS id"
    for r in stopped:
        assert r.response_ids[-1] in engine.eos_token_ids
        assert not engine.eos_token_ids & set(r.response_ids[:-1])


def test_seeds_reproduce_independently_of_batch(engine):
    a = run(engine, PROMPTS, temperature=1.0, max_new_tokens=8, seed=7)
    b = run(engine, PROMPTS, temperature=1.0, max_new_tokens=8, seed=7)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    alone = run(engine, PROMPTS[1:2], temperature=1.0, max_new_tokens=8, seed=7)[0]
    assert alone.response_ids == a[1].response_ids
    torch.testing.assert_close(alone.logprobs, a[1].logprobs, atol=1e-5, rtol=0)
    other = run(engine, PROMPTS, temperature=1.0, max_new_tokens=8, seed=8)
    assert [r.response_ids for r in other] != [r.response_ids for r in a]


def test_resumed_request_continues_like_an_uninterrupted_one(engine):
    full = run(engine, [PROMPTS[2]], temperature=1.0, max_new_tokens=8, seed=3)[0]
    assert len(full.response_ids) > 3, "precondition"
    resumed_req = GenerationRequest(
        "r",
        PROMPTS[2],
        SamplingParams(temperature=1.0, max_new_tokens=8, seed=3),
        prefix_response_ids=full.response_ids[:2],
        prefix_logprobs=full.logprobs[:2],
        prefix_versions=[0, 0],
    )
    resumed = asyncio.run(engine.generate([resumed_req]))[0]
    assert resumed.response_ids == full.response_ids
    torch.testing.assert_close(resumed.logprobs, full.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer_forward(model_dir, engine, temperature):
    """THE consistency contract: rollout logprobs == trainer logprobs (no top-k/p, fp32)."""
    from relax.core.trainers.torch_trainer import TorchTrainer

    results = run(engine, PROMPTS * 2, temperature=temperature, max_new_tokens=10, seed=21)
    lengths = {len(r.response_ids) for r in results}
    assert len(lengths) > 1, "precondition: responses of different lengths (right padding)"
    samples = [
        Sample(prompt_ids=p, group_id=0, response_ids=r.response_ids, rollout_logprobs=r.logprobs)
        for p, r in zip(PROMPTS * 2, results, strict=True)
    ]
    batch = collate(samples, pad_id=engine.pad_token_id)
    trainer = TorchTrainer(model_dir, micro_batch_size=3, temperature=temperature)
    trained = trainer.forward_logprobs(batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(trained[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)
    assert trained[mask].min() < -1.0  # the check is not vacuous (not all ~0)


def test_update_weights_changes_output_and_version(model_dir, engine):
    before = run(engine, PROMPTS, temperature=0.0, max_new_tokens=5)
    other = HFRolloutEngine(build_tiny_model(f"{model_dir}-other", seed=2, initializer_range=0.3))
    engine.update_weights(other.model.state_dict().items(), version=3)
    assert engine.weight_version() == 3
    after = run(engine, PROMPTS, temperature=0.0, max_new_tokens=5)
    assert [r.response_ids for r in after] == [
        r.response_ids for r in run(other, PROMPTS, temperature=0.0, max_new_tokens=5)
    ]
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    assert all(v == 3 for r in after for v in r.versions)


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    weight = engine.model.model.norm.weight
    snapshot = weight.clone()
    with pytest.raises(KeyError, match="model.not_a_layer.weight"):
        engine.update_weights(
            {"model.norm.weight": torch.zeros_like(weight), "model.not_a_layer.weight": weight}, 1
        )
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], 1)
    assert torch.equal(weight, snapshot) and engine.weight_version() == 0  # nothing applied


def test_pause_holds_generation_at_a_token_boundary(engine):
    async def scenario():
        engine.pause()
        task = asyncio.ensure_future(
            engine.generate([GenerationRequest("p", PROMPTS[0], SamplingParams(max_new_tokens=4))])
        )
        await asyncio.sleep(0.1)
        assert not task.done()
        health = engine.health()
        assert health["paused"] and health["in_flight"] == 1
        engine.resume()
        return await asyncio.wait_for(task, timeout=10)

    result = asyncio.run(scenario())[0]
    assert 1 <= len(result.response_ids) <= 4
    assert not engine.health()["paused"] and engine.health()["in_flight"] == 0


def test_weights_updated_mid_generation_show_in_per_token_versions(engine):
    def long_enough(seed):
        return len(run(engine, [PROMPTS[0]], max_new_tokens=6, seed=seed)[0].response_ids) == 6

    seed = next(s for s in range(100) if long_enough(s))
    same_weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def scenario():
        req = GenerationRequest("v", PROMPTS[0], SamplingParams(max_new_tokens=6, seed=seed))
        task = asyncio.ensure_future(engine.generate([req]))
        for _ in range(3):  # the engine yields once per token
            await asyncio.sleep(0)
        engine.update_weights(same_weights, version=1)
        return await task

    versions = asyncio.run(scenario())[0].versions
    assert len(versions) == 6 and versions == sorted(versions)
    assert versions[0] == 0 and versions[-1] == 1


def test_zero_budget_and_empty_request_list(engine):
    assert asyncio.run(engine.generate([])) == []
    req = GenerationRequest(
        "z",
        PROMPTS[1],
        SamplingParams(max_new_tokens=2),
        prefix_response_ids=[10, 11],
        prefix_logprobs=[-1.0, -2.0],
        prefix_versions=[0, 0],
    )
    res = asyncio.run(engine.generate([req]))[0]
    assert res.response_ids == [10, 11] and res.finish_reason == "length" and res.text == "34"
