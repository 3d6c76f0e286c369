"""Pause/continue with requests in flight, per ``pause_mode``: every request finishes with its full budget,
and a weight update during the pause shows in the per-token versions (old tokens keep the old version)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import load_hf_weights
from relax.sglang.testing import load_weights

BUDGET = 160
STEP_SLEEP_S = 0.02  # with it, BUDGET tokens take >= 3.2 s: requests are mid-flight when the pause lands


def slow_down(engine, seconds: float | None) -> None:
    """SGLang's test hook ``/slow_down``: every forward step of the server sleeps ``seconds`` (None: off), so
    requests are still decoding 0.2-0.4 s after they were sent however fast the machine is."""
    for worker in engine.workers:
        worker.post("/slow_down", {"forward_sleep_time": seconds})


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_with_requests_in_flight_then_continue(mode, sglang_engine, tiny_dirs):
    engine = sglang_engine
    engine.params = dataclasses.replace(engine.params, pause_mode=mode)
    version = engine.weight_version()
    reqs = [
        GenerationRequest(
            f"p{mode}{i}", [4, 5, 6 + i], SamplingParams(max_new_tokens=BUDGET, ignore_eos=True, seed=i)
        )
        for i in range(3)
    ]

    async def scenario():
        await asyncio.to_thread(slow_down, engine, STEP_SLEEP_S)
        task = asyncio.ensure_future(engine.generate(reqs))
        await asyncio.sleep(0.2)  # in flight on the server
        await asyncio.to_thread(engine.pause)
        try:
            await asyncio.to_thread(slow_down, engine, None)
            await asyncio.sleep(0.5)
            held = not task.done()
            weights = load_hf_weights(tiny_dirs[1])
            await asyncio.to_thread(engine.begin_weight_update, version + 1)
            await asyncio.to_thread(engine.update_weights, list(weights.items()), version + 1)
            await asyncio.to_thread(engine.end_weight_update, version + 1)
        finally:
            await asyncio.to_thread(engine.resume)
        return held, await asyncio.wait_for(task, 300)

    try:
        held, results = asyncio.run(asyncio.wait_for(scenario(), 600))
    finally:
        slow_down(engine, None)
        load_weights(engine, tiny_dirs[0], version + 2)
        engine.params = dataclasses.replace(engine.params, pause_mode="retract")
    for r in results:
        assert (len(r.response_ids), r.finish_reason) == (BUDGET, "length"), (
            mode,
            len(r.response_ids),
            r.finish_reason,
        )
        assert len(r.logprobs) == len(r.versions) == BUDGET
        assert set(r.versions) <= {version, version + 1}, r.versions
        assert r.versions == sorted(r.versions), f"versions must not go back: {r.versions}"
    assert held, f"{mode}: the requests finished although the engine was paused"
    assert any(version + 1 in r.versions for r in results), (
        f"{mode}: no token came from the weights loaded during the pause: {[r.versions for r in results]}"
    )


def test_abort_then_resubmit_from_scratch_carries_exact_versions(sglang_engine, tiny_dirs):
    """``rollout.partial_rollout: abort``: in-flight requests end as ``abort`` with old-version tokens only;
        sent again from scratch after the update, every token is the new weights' (HF greedy on them) and
        carries the new version -- no token of the aborted attempt leaks into the resubmission (the controller
    resends aborted requests from scratch, see ``relax.core.controller.router.stream_groups``)."""
    from relax.core.engines.hf import HFRolloutEngine

    engine, version = sglang_engine, sglang_engine.weight_version()
    reqs = [
        GenerationRequest(
            f"a{i}", [4, 5, 6 + i], SamplingParams(temperature=0.0, max_new_tokens=BUDGET, ignore_eos=True)
        )
        for i in range(3)
    ]

    async def scenario():
        await asyncio.to_thread(slow_down, engine, STEP_SLEEP_S)
        task = asyncio.ensure_future(engine.generate(reqs))
        await asyncio.sleep(0.4)  # on the server (one still in transit ends as abort too, with no tokens)
        await asyncio.to_thread(engine.pause)
        try:
            await asyncio.to_thread(slow_down, engine, None)
            await asyncio.to_thread(engine.abort)
            aborted = await asyncio.wait_for(task, 120)  # returned while still paused
            await asyncio.to_thread(engine.begin_weight_update, version + 1)
            await asyncio.to_thread(
                engine.update_weights, list(load_hf_weights(tiny_dirs[1]).items()), version + 1
            )
            await asyncio.to_thread(engine.end_weight_update, version + 1)
        finally:
            await asyncio.to_thread(engine.resume)
        return aborted, await asyncio.wait_for(engine.generate(reqs), 300)

    try:
        aborted, again = asyncio.run(asyncio.wait_for(scenario(), 600))
    finally:
        slow_down(engine, None)
        load_weights(engine, tiny_dirs[0], version + 2)
    for r in aborted:
        assert r.finish_reason == "abort" and len(r.response_ids) < BUDGET, (
            r.finish_reason,
            len(r.response_ids),
        )
        assert r.versions == [version] * len(r.response_ids), r.versions
    want = asyncio.run(asyncio.wait_for(HFRolloutEngine(tiny_dirs[1]).generate(reqs), 300))
    for r, w in zip(again, want, strict=True):
        assert (r.finish_reason, r.versions) == ("length", [version + 1] * BUDGET), (
            r.finish_reason,
            set(r.versions),
        )
        # the head only: over 160 float32 steps a near-tie may flip between two correct implementations
        assert r.response_ids[:16] == w.response_ids[:16], (
            "the resubmission did not decode from scratch on the new weights"
        )
