"""Multi-turn prefix reuse in the HF engine: a request continuing a finished one prefills only its new
suffix, with the same tokens and logprobs as re-prefilling the whole context."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from relax.core.agentic import EpisodeLimits, NoToolCalls, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.engines import kv_batch
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.prefix_cache import BLOCK, PrefixCache, layers_nbytes
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.protocols import GenerationRequest, SamplingParams, StepResult
from relax.core.testing import RolloutEngineConformance
from relax.core.testing.models import OTHER_MODEL_SEED, load_hf_weights, tiny_model_dir

# different lengths (left padding, cached prefixes of different widths); the first spans several index blocks
PROMPTS = [[1, 4, 23, 10, 17, 11, 20, 2, 23, 1, 5, 23] * 3, [10, 17, 11, 20], [12, 18, 9, 20, 5, 23], [7]]
OBSERVATION = [5, 6, 7, 8, 9, 10, 11]
MB = 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(
        tmp_path_factory.getbasetemp()
    )  # the conformance kit's model, built once per session


def kv(length: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A per-layer (keys, values) entry of ``length`` positions whose values name their position."""
    pos = torch.arange(length, dtype=torch.float32)[None, None, :, None].expand(1, 2, length, 4).contiguous()
    return [(pos.clone(), pos.clone()) for _ in range(layers)]


# ---------------------------------------------------------------------------------------------- the cache
def test_longest_cached_prefix_is_served_cut_to_leave_a_token_to_prefill():
    cache = PrefixCache(MB)
    long = list(range(100, 100 + 2 * BLOCK + 3))  # spans two whole index blocks and a partial one
    cache.put(long[:5], kv(5), version=0)
    cache.put(long[: BLOCK + 1], kv(BLOCK + 1), version=0)
    cache.put(long, kv(len(long)), version=0)
    cache.put([7, *long[1:9]], kv(9), version=0)  # differs in its first token: never a prefix of ``long``
    hit = cache.longest_prefix([*long, 1, 2], version=0)
    assert hit.length == len(long) and hit.layers[0][0].shape[-2] == len(long)
    hit = cache.longest_prefix([*long[:20], 3], version=0)  # the full entry diverges at 20: the next longest
    assert hit.length == BLOCK + 1
    # a prompt equal to a cached sequence reuses all but its last token (whose logits are needed)
    hit = cache.longest_prefix(long, version=0)
    assert hit.length == len(long) - 1 and hit.layers[1][1].shape[-2] == len(long) - 1
    assert hit.layers[0][0][0, 0, :, 0].tolist() == list(range(len(long) - 1))
    assert cache.longest_prefix([long[0] + 1, *long[1:]], version=0) is None
    assert cache.longest_prefix([3], version=0) is None
    stats = cache.stats()
    assert (stats["prefix_cache_lookups"], stats["prefix_cache_hits"]) == (5, 3)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(3 / 5)
    assert stats["prefix_cache_reused_tokens"] == len(long) + BLOCK + 1 + len(long) - 1


def test_lru_by_bytes_evicts_oldest_and_used_entries_first():
    size = layers_nbytes(kv(10))
    cache = PrefixCache(3 * size)
    for first in (1, 2, 3):
        cache.put([first] * 10, kv(10), version=0)
    assert len(cache) == 3 and cache.nbytes == 3 * size
    assert cache.longest_prefix([2] * 10 + [0], version=0).length == 10  # 2 served a hit: superseded soon
    cache.longest_prefix([0], version=0)
    cache.put([4] * 10, kv(10), version=0)  # over capacity: the used entry goes before the oldest unused
    assert cache.longest_prefix([2] * 11, version=0) is None
    assert cache.longest_prefix([1] * 11, version=0).length == 10
    cache.put([5] * 10, kv(10), version=0)  # 1 just served a hit: evicted before 3, the oldest unused
    assert (
        cache.longest_prefix([1] * 11, version=0) is None
        and cache.longest_prefix([3] * 11, version=0).length == 10
    )
    assert cache.nbytes == 3 * size and cache.stats()["prefix_cache_evictions"] == 2
    cache.put([6] * 40, kv(40), version=0)  # bigger than the whole cache: not kept, nothing evicted
    assert len(cache) == 3 and cache.longest_prefix([6] * 41, version=0) is None
    assert PrefixCache(0).longest_prefix([1] * 11, version=0) is None  # 0 MB: off


def test_entries_of_other_weights_are_never_served():
    cache = PrefixCache(MB)
    cache.put([1, 2, 3], kv(3), version=0)
    assert cache.longest_prefix([1, 2, 3, 4], version=1) is None
    assert len(cache) == 0 and cache.nbytes == 0
    cache.put([1, 2, 3], kv(3), version=1)
    assert cache.longest_prefix([1, 2, 3, 4], version=1).length == 3


def test_suffix_inputs_continue_each_rows_cached_positions():
    ids, mask, positions = kv_batch.suffix_inputs([3, 1], [(7,), (8, 9)], pad_token_id=0)
    assert ids.tolist() == [[0, 7], [8, 9]]
    assert mask.tolist() == [[1, 1, 1, 0, 1], [0, 0, 1, 1, 1]]  # cache columns, then the (left-padded) suffix
    assert positions[0, 1].item() == 3 and positions[1].tolist() == [1, 2]


def test_row_after_gap_joins_cached_and_new_positions():
    from transformers import DynamicCache

    # row 1 of a cache: 3 cached columns (1 real) + 2 new columns (1 real); values name the column
    columns = torch.arange(5, dtype=torch.float32)[None, None, :, None].expand(2, 1, 5, 2).contiguous()
    cache = DynamicCache(ddp_cache_data=[(columns, columns + 10)])
    ((keys, values),) = kv_batch.row_layers_after_gap(
        cache, 1, cache_width=3, cached_length=1, suffix_length=1
    )
    assert keys[0, 0, :, 0].tolist() == [2.0, 4.0] and values[0, 0, :, 0].tolist() == [12.0, 14.0]


# --------------------------------------------------------------------------------------------- the engine
def continue_turns(engine, turns: int, new_weights_at: int | None = None, weights=None):
    """``turns`` turns of every prompt (twice each: a group of two), each turn's prompt = the previous
    prompt + its response + an observation; one fresh prompt joins the third turn's batch.
    Returns the results and each turn's (prefix cache lookups, hits)."""
    history = [list(p) for p in PROMPTS for _ in range(2)]
    results, counts = [], []
    for turn in range(turns):
        before = engine.health()
        if turn == new_weights_at:
            engine.update_weights(weights, version=turn)
        requests = [
            GenerationRequest(
                f"{i}/t{turn}", h, SamplingParams(max_new_tokens=8, seed=100 * turn + i), continues=True
            )
            for i, h in enumerate(history)
        ]
        if turn == 2:
            requests.append(GenerationRequest("fresh", [9, 9, 9], SamplingParams(max_new_tokens=5, seed=3)))
        out = asyncio.run(engine.generate(requests))
        results.append(out)
        after = engine.health()
        counts.append(tuple(after[k] - before[k] for k in ("prefix_cache_lookups", "prefix_cache_hits")))
        for h, r in zip(history, out, strict=False):
            h += r.response_ids + OBSERVATION[: turn + 2]  # observations of different lengths
    return results, counts


def assert_same(reused, fresh):
    for turn_a, turn_b in zip(reused, fresh, strict=True):
        for a, b in zip(turn_a, turn_b, strict=True):
            assert a.response_ids == b.response_ids, a.request_id
            assert a.finish_reason == b.finish_reason and a.versions == b.versions
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("capacity_mb", [16.0, 0.05])
def test_continued_turns_equal_re_prefilling_them(model_dir, capacity_mb):
    reused_engine, fresh_engine = (
        HFRolloutEngine(model_dir, prefix_cache_mb=capacity_mb),
        HFRolloutEngine(model_dir),
    )
    (reused, counts), (fresh, _) = continue_turns(reused_engine, 4), continue_turns(fresh_engine, 4)
    assert_same(reused, fresh)
    assert counts[0] == (len(PROMPTS), 0)  # one lookup per distinct context (a group shares its prefill)
    assert len({len(r.response_ids) for t in fresh for r in t}) > 2, (
        "precondition: responses of several lengths"
    )
    health = reused_engine.health()
    assert health["prefix_cache_bytes"] <= capacity_mb * MB
    assert reused_engine.stats["prefill_tokens"] < fresh_engine.stats["prefill_tokens"]
    if capacity_mb >= 1:  # room for everything: every continued turn is a hit, the fresh prompt a miss
        assert [hits for _, hits in counts] == [0, counts[1][0], counts[2][0] - 1, counts[3][0]]
        assert counts[1][0] >= len(PROMPTS)
        assert health["prefix_cache_hit_rate"] == pytest.approx(
            health["prefix_cache_hits"] / health["prefix_cache_lookups"]
        )
        assert reused_engine.stats["prefill_tokens"] < fresh_engine.stats["prefill_tokens"] / 3
    else:  # room for a few entries only: some turns re-prefill, outputs are the same
        assert health["prefix_cache_evictions"] > 0 and 0 < health["prefix_cache_hits"] < 3 * 2 * len(PROMPTS)
    assert fresh_engine.health()["prefix_cache_lookups"] == 0  # 0 MB: off


def test_weight_update_clears_kept_kv(model_dir, tmp_path_factory):
    weights = load_hf_weights(tiny_model_dir(tmp_path_factory.getbasetemp(), OTHER_MODEL_SEED))
    reused_engine = HFRolloutEngine(model_dir, prefix_cache_mb=16)
    continue_turns(reused_engine, 2)
    assert reused_engine.health()["prefix_cache_entries"] > 0
    reused_engine.update_weights(weights, version=5)
    assert reused_engine.health()["prefix_cache_entries"] == 0
    assert reused_engine.health()["prefix_cache_bytes"] == 0
    # a run whose weights change before turn 2: turn 2 re-prefills (stale KV would change its tokens),
    # turn 3 reuses turn 2's KV of the new weights
    reused_engine = HFRolloutEngine(model_dir, prefix_cache_mb=16)
    fresh_engine = HFRolloutEngine(model_dir)
    reused, counts = continue_turns(reused_engine, 4, new_weights_at=2, weights=weights)
    assert_same(reused, continue_turns(fresh_engine, 4, new_weights_at=2, weights=weights)[0])
    assert [hits for _, hits in counts] == [0, counts[1][0], 0, counts[3][0]] and counts[3][0] > 0


def test_rows_decoded_across_a_weight_update_are_not_kept(model_dir):
    engine = HFRolloutEngine(model_dir, prefix_cache_mb=16)
    same_weights = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def scenario():
        req = GenerationRequest(
            "v", PROMPTS[0], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=1), continues=True
        )
        task = asyncio.ensure_future(engine.generate([req]))
        for _ in range(3):  # the engine yields once per token
            await asyncio.sleep(0)
        engine.update_weights(same_weights, version=1)
        return await task

    versions = asyncio.run(scenario())[0].versions
    assert versions[0] == 0 and versions[-1] == 1, "precondition: the update landed mid-generation"
    assert engine.health()["prefix_cache_entries"] == 0


def test_hosted_engine_never_serves_kv_of_weights_before_a_publish(model_dir):
    """The trainer-hosted engine's weights change in place: a published version makes kept KV stale."""
    from transformers import AutoModelForCausalLM

    from relax.core.engines.hosted import HostedHFEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hosted = HostedHFEngine(
        model, AutoTokenizer.from_pretrained(model_dir), model_path=model_dir, prefix_cache_mb=16
    )
    plain = HFRolloutEngine(model_dir, model=model, tokenizer=hosted.tokenizer)  # same module, nothing kept
    prompt = PROMPTS[0]

    def turn(engine, ids, seed):
        return asyncio.run(
            engine.generate(
                [GenerationRequest("h", ids, SamplingParams(max_new_tokens=6, seed=seed), continues=True)]
            )
        )[0]

    first = turn(hosted, prompt, 1)
    second_prompt = prompt + first.response_ids + OBSERVATION
    with torch.no_grad():  # a train step: every weight written in place
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    hosted.end_weight_update(1)
    second = turn(hosted, second_prompt, 2)
    assert hosted.health()["prefix_cache_hits"] == 0  # the kept turn-1 KV was of version 0
    reference = turn(plain, second_prompt, 2)
    assert second.response_ids == reference.response_ids
    torch.testing.assert_close(second.logprobs, reference.logprobs, atol=1e-4, rtol=0)
    turn(hosted, second_prompt + second.response_ids + OBSERVATION, 3)
    assert hosted.health()["prefix_cache_hits"] == 1  # KV of the published weights is reused


class OneLine:
    """Deterministic episodes: each turn is answered with the same short user message; done after 3 turns."""

    def start(self, sample):
        class Episode:
            def step(self, turn):
                if turn.index >= 2:
                    return StepResult(done=True, reward=1.0)
                return StepResult([{"role": "user", "content": "again"}])

            def close(self):
                pass

        return Episode()


class Blocking:
    """The engine as a driver-side rollout role calls it (``controller.roles.RolloutRole.generate``)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests):
        return asyncio.run(self.engine.generate(requests))


def rollout(model_dir, engine):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = EpisodeLimits(max_turns=4, max_total_tokens=200, turn_timeout_s=10.0)
    turns = Turns(OneLine(), NoToolCalls(), tokenizer, limits, stop_token_ids(tokenizer))
    prompt = tokenizer("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    groups = [
        [Sample(prompt_ids=list(prompt), group_id=g, index_in_group=i) for i in range(2)] for g in range(2)
    ]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    for _ in stream_groups(
        EngineRouter([LocalHandle(Blocking(engine))]),
        groups,
        params,
        seed=3,
        step=1,
        timeout_s=60,
        turns=turns,
    ):
        pass
    return [s for g in groups for s in g]


def test_episodes_through_turns_are_identical_with_prefix_reuse(model_dir):
    reused_engine, fresh_engine = HFRolloutEngine(model_dir, prefix_cache_mb=16), HFRolloutEngine(model_dir)
    reused, fresh = rollout(model_dir, reused_engine), rollout(model_dir, fresh_engine)
    for a, b in zip(reused, fresh, strict=True):
        assert a.metadata["episode"]["turns"] == b.metadata["episode"]["turns"] == 3
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4, rtol=0)
    health = reused_engine.health()
    # every turn after the first continues a kept sequence (the two chunks' first prompts may miss)
    assert health["prefix_cache_hits"] >= max(1, health["prefix_cache_lookups"] - 2)
    assert reused_engine.stats["prefill_tokens"] < fresh_engine.stats["prefill_tokens"] / 2


class TestHFEngineWithPrefixCacheConformance(RolloutEngineConformance):
    """The engine contract holds with the prefix cache on (continued prefixes, updates, aborts)."""

    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir, prefix_cache_mb=16)


def test_requests_no_later_turn_continues_keep_nothing(model_dir):
    """Single-completion rollouts (``continues`` False) pay nothing for the cache."""
    engine = HFRolloutEngine(model_dir, prefix_cache_mb=64)
    requests = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=4, seed=i)) for i, p in enumerate(PROMPTS)
    ]
    asyncio.run(engine.generate(requests))
    assert engine.health()["prefix_cache_entries"] == 0
