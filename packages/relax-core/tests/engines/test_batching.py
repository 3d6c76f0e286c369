"""Continuous batching and shared-prefix prefill give exactly what one-at-a-time generation gives."""

import asyncio
import threading

import pytest
import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import build_tiny_model

# different lengths (left padding), and a one-token prompt (nothing to prefill)
PROMPTS = [[1, 4, 23, 10, 17, 11, 20, 2, 23, 1, 5, 23], [10, 17, 11, 20], [12, 18, 9, 20, 5, 23], [7]]
G = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a larger init scale than the quick-start's makes the distributions far from uniform
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir, max_batch_size=5)  # 16 requests: rows join as others finish


def group_requests(**params):
    """G requests per prompt, each with its own seed (as the controller sends a step)."""
    return [
        GenerationRequest(f"{p}/{i}", prompt, SamplingParams(seed=100 * p + i, **params))
        for p, prompt in enumerate(PROMPTS)
        for i in range(G)
    ]


def one_at_a_time(engine, requests):
    return [asyncio.run(engine.generate([r]))[0] for r in requests]


def assert_same(got, expected, versions=True):
    for g, e in zip(got, expected, strict=True):
        assert g.request_id == e.request_id
        assert (g.response_ids, g.finish_reason) == (e.response_ids, e.finish_reason), g.request_id
        # fp32 noise only: the same math at other batch shapes (the old static batcher showed 8e-6)
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=5e-5, rtol=0)
        assert g.versions == e.versions or not versions


SETTINGS = {
    "t1": dict(temperature=1.0, max_new_tokens=14),
    "t0.7": dict(temperature=0.7, max_new_tokens=14),
    "topk-topp": dict(temperature=0.9, top_k=6, top_p=0.8, max_new_tokens=14),
    "stop-strings": dict(temperature=1.0, max_new_tokens=14, ignore_eos=True, stop=("3", "==")),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_batched_groups_equal_one_at_a_time(engine, setting):
    requests = group_requests(**SETTINGS[setting])
    expected = one_at_a_time(engine, requests)
    assert len({len(r.response_ids) for r in expected}) > 2, "precondition: a spread of response lengths"
    assert {r.finish_reason for r in expected} == {"stop", "length"}, "precondition: some stop early"
    before = dict(engine.stats)
    got = asyncio.run(engine.generate(requests))
    assert_same(got, expected)
    work = {k: engine.stats[k] - before[k] for k in before}
    # no work for finished rows: every decoded row produced one returned token
    assert work["decode_rows"] == sum(len(r.response_ids) for r in got)
    # continuous batching: fewer steps than 5-row chunks decoded to their longest member
    chunks = [got[i : i + 5] for i in range(0, len(got), 5)]
    assert work["decode_steps"] < sum(max(len(r.response_ids) for r in c) for c in chunks)
    # one prefill per group, although its members join at different steps; it samples their first tokens
    assert work["prefill_rows"] == len(PROMPTS)


def test_a_group_is_prefilled_once(model_dir):
    engine = HFRolloutEngine(model_dir)
    requests = group_requests(temperature=1.0, max_new_tokens=6)
    got = asyncio.run(engine.generate(requests))
    assert engine.stats["prefill_rows"] == len(PROMPTS)  # one per group: it also gives the first tokens
    assert_same(got, one_at_a_time(engine, requests))
    assert len({tuple(r.response_ids) for r in got[:G]}) > 1, "the G samples of a group differ"


def test_resumed_and_fresh_requests_batch_together(engine):
    fresh = group_requests(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    full = one_at_a_time(engine, fresh)
    resumed = [
        GenerationRequest(
            r.request_id,
            r.prompt_ids,
            r.params,
            prefix_response_ids=f.response_ids[:k],
            prefix_logprobs=f.logprobs[:k],
            prefix_versions=f.versions[:k],
        )
        for k, (r, f) in enumerate(zip(fresh, full, strict=True))
        if k % 2
    ]
    mixed = [r for k, r in enumerate(fresh) if k % 2 == 0] + resumed
    got = {r.request_id: r for r in asyncio.run(engine.generate(mixed))}
    assert_same([got[r.request_id] for r in fresh], full)


def test_concurrent_calls_share_one_batch(model_dir):
    engine = HFRolloutEngine(model_dir)
    calls = [
        group_requests(temperature=1.0, max_new_tokens=12)[:8],
        group_requests(temperature=0.7, max_new_tokens=9)[8:],
    ]
    expected = [one_at_a_time(engine, c) for c in calls]
    steps_before = engine.stats["decode_steps"]
    results = [None, None]

    def call(i):
        results[i] = asyncio.run(asyncio.wait_for(engine.generate(calls[i]), 60))

    engine.pause()  # both calls queue their requests before the first step
    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while engine.health()["waiting"] < 16:
        threads[0].join(0.01)
    engine.resume()
    for t in threads:
        t.join(60)
    for got, exp in zip(results, expected, strict=True):
        assert_same(got, exp)
    longest = max(len(r.response_ids) for rs in results for r in rs)
    assert engine.stats["decode_steps"] - steps_before == longest  # one shared batch, not two
    assert engine.health()["running"] == engine.health()["waiting"] == 0


def test_a_short_call_returns_while_a_long_one_decodes_in_another_thread(model_dir):
    engine = HFRolloutEngine(model_dir)
    long_req = GenerationRequest("long", PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
    long_call = threading.Thread(target=lambda: asyncio.run(engine.generate([long_req])))
    long_call.start()
    while not engine.health()["running"]:
        long_call.join(0.001)
    short_req = GenerationRequest("short", PROMPTS[1], SamplingParams(max_new_tokens=3))
    short = asyncio.run(engine.generate([short_req]))
    still_running = long_call.is_alive()
    long_call.join(120)
    assert 1 <= len(short[0].response_ids) <= 3
    assert still_running, "the short call waited for the long one (it must return once its rows finish)"


def test_cancelled_call_leaves_the_queue_and_the_batch(engine):
    async def scenario():
        slow = asyncio.ensure_future(engine.generate(group_requests(max_new_tokens=64, ignore_eos=True)))
        await asyncio.sleep(0)
        assert engine.health()["waiting"] == 16 - 5
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert engine.health()["waiting"] == engine.health()["running"] == 0
        return await engine.generate(group_requests(max_new_tokens=3, ignore_eos=True)[:2])

    after = asyncio.run(scenario())
    assert [len(r.response_ids) for r in after] == [3, 3]
    assert engine.health()["running"] == engine.health()["waiting"] == 0


def test_abort_ends_running_and_queued_requests(engine):
    async def scenario():
        task = asyncio.ensure_future(engine.generate(group_requests(max_new_tokens=32, ignore_eos=True)))
        for _ in range(3):
            await asyncio.sleep(0)
        engine.abort()
        return await task

    results = asyncio.run(scenario())
    assert {r.finish_reason for r in results} == {"abort"}
    assert 0 < max(len(r.response_ids) for r in results) < 32
    assert min(len(r.response_ids) for r in results) == 0  # still queued when the abort came
    assert engine.health()["running"] == engine.health()["waiting"] == 0


@pytest.mark.parametrize(
    ("prompt", "error"),
    [([], "request 'e' has no prompt_ids"), ([4, 24, -1], r"token ids outside \[0, 24\): \[24, -1\]")],
)
def test_bad_prompt_is_a_clear_error(engine, prompt, error):
    with pytest.raises(ValueError, match=error):
        asyncio.run(engine.generate([GenerationRequest("e", prompt, SamplingParams())]))


def test_a_failed_step_fails_every_call_in_it(tmp_path):
    path = build_tiny_model(tmp_path, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    engine = HFRolloutEngine(path)
    assert (
        not engine.continuous_batching
    )  # a sliding-window cache decodes in static batches (test_model_families)
    engine.continuous_batching = True  # forced: the shared batch's step then fails on the cache it cannot cut

    async def two_calls():
        engine.pause()  # both calls queue before the first step, so they share it
        calls = [
            asyncio.ensure_future(engine.generate([GenerationRequest(str(i), p, SamplingParams())]))
            for i, p in enumerate(PROMPTS[:2])
        ]
        await asyncio.sleep(0.05)
        engine.resume()
        return await asyncio.gather(*calls, return_exceptions=True)

    errors = asyncio.run(two_calls())
    assert sorted(type(e).__name__ for e in errors) == ["NotImplementedError", "RuntimeError"]
    for e in errors:  # the layer type is named, whichever call ran the step
        assert "DynamicSlidingWindowLayer" in str(e)
    assert engine.health()["running"] == engine.health()["waiting"] == 0


def test_kept_prefill_is_dropped_when_weights_change(model_dir, tmp_path):
    other = HFRolloutEngine(build_tiny_model(tmp_path, seed=2, initializer_range=0.3))
    engine = HFRolloutEngine(model_dir, max_batch_size=1)  # the group's 2nd and 3rd samples wait
    group = [
        GenerationRequest(f"w{i}", PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True, seed=i))
        for i in range(3)
    ]

    async def scenario():
        task = asyncio.ensure_future(engine.generate(group))
        await asyncio.sleep(0)  # one step: the first sample runs, the prompt's prefill is kept for the others
        engine.update_weights(other.model.state_dict(), version=1)
        return await task

    got = asyncio.run(scenario())
    assert got[0].versions[0] == 0 and engine.stats["prefill_rows"] == 2  # prefilled again after the update
    assert_same(got[1:], one_at_a_time(other, group[1:]), versions=False)
    assert all(v == 1 for r in got[1:] for v in r.versions)
