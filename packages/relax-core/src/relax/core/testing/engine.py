"""``RolloutEngineConformance``: the generation contract every rollout engine keeps.

Checks what the controller relies on: per-token logprobs/versions aligned with the response,
finish reasons, ``max_new_tokens``, seeds, ``temperature`` / ``top_k`` / ``top_p``, stop ids/strings,
``ignore_eos``, partial-rollout prefixes, pause/resume, the optional ``abort``, and
``update_weights`` switching what is served.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from relax.core.protocols import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from relax.core.testing.models import TinyModelFixtures, eos_token_ids, load_hf_weights, run_async

FINISH_REASONS = frozenset({"stop", "length", "abort"})
PROMPT_TEXTS = ("3+4=", "12*3-5=?", "7", "99 - 1 = ")  # different lengths: left padding matters


class EngineFixtures(TinyModelFixtures):
    """The ``engine`` fixture (one per test class) and the calls the suites make on it."""

    #: seconds any single ``generate`` may take before the test fails
    timeout_s: float = 120.0

    def make_engine(self, model_dir: str) -> RolloutEngine:
        """Build the engine under test on the HF model directory ``model_dir`` (fp32 preferred)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_engine(self, model_dir)")

    def close_engine(self, engine: Any) -> None:
        """Release what ``make_engine`` started (processes, GPU memory). Default: nothing."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_dir: str) -> Iterator[Any]:
        suite = cls()
        engine = suite.make_engine(model_dir)
        yield engine
        suite.close_engine(engine)

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls, tokenizer: Any) -> list[list[int]]:
        return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPT_TEXTS]

    def run_async(self, coro: Any) -> Any:
        """Run one coroutine against the engine (override for engines bound to their own loop)."""
        return run_async(coro, self.timeout_s)

    def generate(
        self, engine: Any, prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None = None, **params: Any
    ) -> list[GenerationResult]:
        """One ``generate`` call, one request per prompt (``seeds[i]`` for request i); checks ids and order."""
        reqs = [
            GenerationRequest(
                f"conformance-{i}",
                list(p),
                SamplingParams(**params, **({} if seeds is None else {"seed": seeds[i]})),
            )
            for i, p in enumerate(prompts)
        ]
        results = self.run_async(engine.generate(reqs))
        got = [r.request_id for r in results]
        assert got == [r.request_id for r in reqs], (
            f"generate must return one result per request, in order: {got}"
        )
        return results


def check_result(result: GenerationResult, max_new_tokens: int, version: int | None) -> None:
    """The per-result contract (``version=None`` skips the version check)."""
    ids, n = result.response_ids, len(result.response_ids)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids), (
        f"response_ids must be a list of int: {ids!r}"
    )
    assert n <= max_new_tokens, f"{n} tokens > max_new_tokens {max_new_tokens}"
    assert len(result.logprobs) == n and len(result.versions) == n, (
        f"{n} tokens but {len(result.logprobs)} logprobs and {len(result.versions)} versions"
    )
    bad = [lp for lp in result.logprobs if not (math.isfinite(lp) and lp <= 1e-6)]
    assert not bad, f"logprobs must be finite and <= 0, got {bad}"
    if version is not None:
        assert all(v == version for v in result.versions), (
            f"versions {result.versions} != weight_version() {version}"
        )
    assert result.finish_reason in FINISH_REASONS, (
        f"finish_reason {result.finish_reason!r} not in {sorted(FINISH_REASONS)}"
    )
    if result.finish_reason == "length":
        assert n == max_new_tokens, f"finish_reason 'length' after {n} of {max_new_tokens} tokens"
    elif result.finish_reason == "stop":
        assert n >= 1, "finish_reason 'stop' with an empty response"
    if n < max_new_tokens:
        assert result.finish_reason in ("stop", "abort"), (
            f"{n} < {max_new_tokens} tokens with {result.finish_reason!r}"
        )
    assert isinstance(result.text, str)


def _plain(tokenizer: Any, ids: Sequence[int]) -> list[bool]:
    special = set(tokenizer.all_special_ids)
    return [t not in special for t in ids]


class RolloutEngineConformance(EngineFixtures):
    """Subclass as ``class TestMyEngine(RolloutEngineConformance)`` and implement ``make_engine``.

    One engine serves the whole class (tests restore the weights they change). Optional
    capabilities (``abort``) are skipped with a reason when the engine lacks them.
    """

    #: tokens per response in most checks (kept small: CPU CI)
    max_new_tokens: int = 8
    #: how long a paused engine must hold a request to count as paused
    pause_probe_s: float = 0.3
    #: logprob tolerance when comparing the same weights across two engine instances
    logprob_atol: float = 1e-4

    def test_is_a_rollout_engine(self, engine):
        assert isinstance(engine, RolloutEngine), f"{type(engine).__name__} lacks RolloutEngine methods"
        assert isinstance(engine.weight_version(), int)

    def test_health_returns_a_dict(self, engine):
        health = engine.health()
        assert isinstance(health, dict), f"health() returned {type(health).__name__}, not a dict"

    def test_generation_contract(self, engine, prompts):
        version = engine.weight_version()
        results = self.generate(engine, prompts * 2, temperature=1.0, max_new_tokens=self.max_new_tokens)
        for r in results:
            check_result(r, self.max_new_tokens, version)
            assert r.finish_reason != "abort", "nothing aborted this request"
            assert r.response_ids, "a response of zero tokens with a non-zero budget"

    @pytest.mark.parametrize("budget", [1, 3])
    def test_max_new_tokens_is_exact_with_ignore_eos(self, engine, prompts, budget):
        results = self.generate(
            engine, prompts, seeds=range(len(prompts)), max_new_tokens=budget, ignore_eos=True
        )
        for r in results:
            check_result(r, budget, engine.weight_version())
            assert (len(r.response_ids), r.finish_reason) == (budget, "length")

    def test_same_seed_same_output_different_seed_differs(self, engine, prompts):
        kw = dict(temperature=1.0, max_new_tokens=self.max_new_tokens, ignore_eos=True)
        a = self.generate(engine, prompts, seeds=[7] * len(prompts), **kw)
        b = self.generate(engine, prompts, seeds=[7] * len(prompts), **kw)
        assert [r.response_ids for r in a] == [r.response_ids for r in b], "same seed, different tokens"
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x.logprobs, y.logprobs, atol=self.logprob_atol, rtol=0)
        c = self.generate(engine, prompts, seeds=[8] * len(prompts), **kw)
        assert [r.response_ids for r in c] != [r.response_ids for r in a], (
            "seeds 7 and 8 gave identical samples"
        )

    def _one_candidate(self, engine, prompts, setting: str, **params: Any) -> None:
        """``params`` leave a single candidate token per step, so every seed must give the greedy
        tokens; an engine that ignores the setting samples and the seeds disagree."""
        kw = dict(max_new_tokens=self.max_new_tokens, ignore_eos=True)
        many, seeds = [prompts[0]] * 3, [11, 12, 13]
        free = [r.response_ids for r in self.generate(engine, many, seeds=seeds, temperature=1.0, **kw)]
        assert len({tuple(ids) for ids in free}) > 1, (
            f"precondition: seeds {seeds} at temperature 1 gave {free}"
        )
        got = [r.response_ids for r in self.generate(engine, many, seeds=seeds, **params, **kw)]
        for r in got:
            assert r == got[0], (
                f"{setting} must sample the greedy tokens whatever the seed: seeds {seeds} gave {got}"
            )
        if "temperature" not in params or params["temperature"] > 0:
            (greedy,) = self.generate(engine, [prompts[0]], temperature=0.0, **kw)
            assert got[0] == greedy.response_ids, (
                f"{setting} must sample the greedy tokens {greedy.response_ids}, got {got[0]}"
            )

    def test_temperature_zero_is_greedy(self, engine, prompts):
        self._one_candidate(engine, prompts, "temperature=0", temperature=0.0)

    def test_top_k_one_is_greedy(self, engine, prompts):
        self._one_candidate(engine, prompts, "top_k=1", temperature=1.0, top_k=1)

    def test_tiny_top_p_is_greedy(self, engine, prompts):
        self._one_candidate(engine, prompts, "top_p=1e-6", temperature=1.0, top_p=1e-6)

    def _free_sample(self, engine, prompt, seed, n=12) -> list[int]:
        return self.generate(engine, [prompt], seeds=[seed], max_new_tokens=n, ignore_eos=True)[
            0
        ].response_ids

    def test_stop_token_ids_end_the_response(self, engine, prompts, tokenizer):
        for seed in range(20):
            free = self._free_sample(engine, prompts[0], seed)
            plain = _plain(tokenizer, free)
            pos = next((i for i in range(1, len(free) - 1) if plain[i]), None)
            if pos is not None:
                break
        else:
            pytest.fail("no seed in 0..19 sampled an ordinary token at positions 1..10 (precondition)")
        stop_tok = free[pos]
        expected = free[: free.index(stop_tok) + 1]
        got = self.generate(
            engine, [prompts[0]], seeds=[seed], max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_tok,)
        )[0]
        check_result(got, 12, engine.weight_version())
        assert got.response_ids == expected, (
            f"stop id {stop_tok}: expected {expected}, got {got.response_ids}"
        )
        assert got.finish_reason == "stop"

    def test_stop_strings_end_the_response(self, engine, prompts, tokenizer):
        for seed in range(20):
            free = self._free_sample(engine, prompts[1], seed)
            plain = _plain(tokenizer, free)
            pos = next((i for i in range(1, len(free) - 2) if plain[i] and plain[i + 1]), None)
            if pos is not None:
                stop = tokenizer.decode(free[pos : pos + 2], skip_special_tokens=True)
                if stop.strip():
                    break
        else:
            pytest.fail("no seed in 0..19 sampled two ordinary tokens in a row (precondition)")
        end = next(
            k for k in range(1, len(free) + 1) if stop in tokenizer.decode(free[:k], skip_special_tokens=True)
        )
        got = self.generate(
            engine, [prompts[1]], seeds=[seed], max_new_tokens=12, ignore_eos=True, stop=(stop,)
        )[0]
        check_result(got, 12, engine.weight_version())
        assert got.response_ids == free[:end], (
            f"stop string {stop!r}: expected tokens up to the one completing it, {free[:end]}, got {got.response_ids}"
        )
        assert got.finish_reason == "stop"

    def test_eos_stops_unless_ignore_eos(self, engine, prompts, model_dir):
        eos = eos_token_ids(model_dir)
        many = prompts * 4
        seeds = list(range(100, 100 + len(many)))
        kw = dict(temperature=1.0, max_new_tokens=12)
        ignoring = self.generate(engine, many, seeds=seeds, ignore_eos=True, **kw)
        for full in ignoring:
            assert (len(full.response_ids), full.finish_reason) == (12, "length"), (
                f"ignore_eos must run to max_new_tokens, got {len(full.response_ids)} tokens, {full.finish_reason!r}"
            )
        assert any(eos & set(r.response_ids[:-1]) for r in ignoring), (
            "precondition: some of 16 ignore_eos samples of 12 tokens contain an EOS id"
        )
        stopping = self.generate(engine, many, seeds=seeds, **kw)
        for full, r in zip(ignoring, stopping, strict=True):
            cut = next((i + 1 for i, t in enumerate(full.response_ids) if t in eos), None)
            if cut is None:
                assert r.response_ids == full.response_ids and r.finish_reason == "length"
            else:  # the same seed stops at the first EOS, which is kept in the response
                assert r.response_ids == full.response_ids[:cut], f"EOS {sorted(eos)} must end the response"
                assert r.finish_reason == "stop"

    def test_prefix_response_is_continued(self, engine, prompts):
        full = self._free_sample(engine, prompts[2], seed=3, n=self.max_new_tokens)
        version = engine.weight_version()
        req = GenerationRequest(
            "prefixed",
            prompts[2],
            SamplingParams(max_new_tokens=self.max_new_tokens, seed=3, ignore_eos=True),
            prefix_response_ids=full[:3],
            prefix_logprobs=[-1.5, -2.5, -0.5],  # arbitrary: must be passed through, not recomputed
            prefix_versions=[version - 7] * 3,
        )
        (got,) = self.run_async(engine.generate([req]))
        assert got.response_ids[:3] == full[:3], "the response must start with prefix_response_ids"
        assert len(got.response_ids) == self.max_new_tokens, "max_new_tokens counts the prefix"
        assert got.logprobs[:3] == [-1.5, -2.5, -0.5] and got.versions[:3] == [version - 7] * 3
        assert all(v == version for v in got.versions[3:])
        check_result(got, self.max_new_tokens, None)

    def test_pause_holds_generation_until_resume(self, engine, prompts):
        req = GenerationRequest(
            "paused", prompts[0], SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1)
        )

        async def scenario():
            engine.pause()
            try:
                task = asyncio.ensure_future(engine.generate([req]))
                await asyncio.sleep(self.pause_probe_s)
                held = not task.done()
            finally:
                engine.resume()
            return held, await asyncio.wait_for(task, self.timeout_s)

        held, (result,) = self.run_async(scenario())
        assert held, f"a generate issued while paused finished within {self.pause_probe_s}s, before resume()"
        check_result(result, 4, engine.weight_version())
        assert (len(result.response_ids), result.finish_reason) == (4, "length"), (
            "resume() must let it finish"
        )

    def test_abort_ends_in_flight_requests(self, engine, prompts):
        if not callable(getattr(engine, "abort", None)):
            pytest.skip(f"{type(engine).__name__} has no abort() (optional capability: partial rollout)")
        budget = 64
        reqs = [  # several in one call: an engine that batches in chunks must end them all
            GenerationRequest(
                f"aborted-{i}", p, SamplingParams(max_new_tokens=budget, ignore_eos=True, seed=i)
            )
            for i, p in enumerate(prompts[:3])
        ]

        async def scenario():
            engine.pause()  # so the requests are certainly in flight when abort() arrives
            try:
                task = asyncio.ensure_future(engine.generate(reqs))
                await asyncio.sleep(self.pause_probe_s)
                engine.abort()
            finally:
                engine.resume()
            return await asyncio.wait_for(task, self.timeout_s)

        results = self.run_async(scenario())
        for result in results:
            check_result(result, budget, engine.weight_version())
            assert (result.finish_reason, len(result.response_ids) < budget) == ("abort", True), (
                f"request {result.request_id} of an aborted generate finished with {result.finish_reason!r} "
                f"after {len(result.response_ids)} tokens"
            )
        (after,) = self.generate(engine, [prompts[0]], seeds=[2], max_new_tokens=4, ignore_eos=True)
        assert after.finish_reason == "length", "requests submitted after abort() must run normally"

    def update_weights(self, engine: Any, weights: dict[str, torch.Tensor], version: int) -> None:
        """Apply HF-named ``weights`` as a transport would: begin/end hooks when present, two buckets."""
        items = list(weights.items())
        if callable(getattr(engine, "begin_weight_update", None)):
            engine.begin_weight_update(version)
        half = len(items) // 2
        for bucket in (items[:half], items[half:]):
            engine.update_weights(bucket, version)
        if callable(getattr(engine, "end_weight_update", None)):
            engine.end_weight_update(version)

    def test_update_weights_changes_outputs_and_version(self, engine, prompts, model_dir, other_model_dir):
        kw = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        version = engine.weight_version()
        before = self.generate(engine, prompts, seeds=[1] * len(prompts), **kw)
        reseeded = self.generate(engine, prompts, seeds=[2] * len(prompts), **kw)
        if [r.response_ids for r in reseeded] != [r.response_ids for r in before]:
            pytest.fail(
                "precondition: temperature=0 is not greedy (two seeds gave different tokens), so this "
                "test cannot compare engines; see test_temperature_zero_is_greedy"
            )
        reference = self.make_engine(other_model_dir)
        try:
            expected = self.generate(reference, prompts, **kw)
        finally:
            self.close_engine(reference)
        try:
            self.update_weights(engine, load_hf_weights(other_model_dir), version + 1)
            assert engine.weight_version() == version + 1, "weight_version() must report the new version"
            after = self.generate(engine, prompts, **kw)
        finally:
            self.update_weights(engine, load_hf_weights(model_dir), version + 2)
        for a, e in zip(after, expected, strict=True):
            check_result(a, 6, version + 1)
            assert a.response_ids == e.response_ids, (
                "after update_weights the engine must serve the new weights"
            )
            torch.testing.assert_close(a.logprobs, e.logprobs, atol=self.logprob_atol, rtol=0)
        moved = max(
            abs(x - y)
            for a, b in zip(after, before, strict=True)
            for x, y in zip(a.logprobs, b.logprobs, strict=True)
        )
        assert moved > 1e-3, "outputs did not change although the weights did"
        restored = self.generate(engine, prompts, **kw)
        assert [r.response_ids for r in restored] == [r.response_ids for r in before], "restoring the weights"
        assert all(v == version + 2 for r in restored for v in r.versions)
