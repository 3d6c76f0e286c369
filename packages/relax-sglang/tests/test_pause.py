"""Pause/continue with requests in flight, per ``pause_mode``: every request finishes with its full budget,
and a weight update during the pause shows in the per-token versions (old tokens keep the old version)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import load_hf_weights

BUDGET = 160  # long enough to be mid-flight when the pause lands (~10 ms/token here)


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_with_requests_in_flight_then_continue(mode, sglang_engine, tiny_dirs):
    engine = sglang_engine
    engine.params = dataclasses.replace(engine.params, pause_mode=mode)
    version = engine.weight_version()
    reqs = [GenerationRequest(f"p{mode}{i}", [4, 5, 6 + i], SamplingParams(max_new_tokens=BUDGET, ignore_eos=True, seed=i))
            for i in range(3)]  # fmt: skip

    async def scenario():
        task = asyncio.ensure_future(engine.generate(reqs))
        await asyncio.sleep(0.2)  # in flight on the server
        await asyncio.to_thread(engine.pause)
        try:
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
        restore = list(load_hf_weights(tiny_dirs[0]).items())
        engine.begin_weight_update(version + 2)
        engine.update_weights(restore, version + 2)
        engine.end_weight_update(version + 2)
        engine.params = dataclasses.replace(engine.params, pause_mode="retract")
    for r in results:
        assert (len(r.response_ids), r.finish_reason) == (BUDGET, "length"), (mode, len(r.response_ids), r.finish_reason)
        assert len(r.logprobs) == len(r.versions) == BUDGET
        assert set(r.versions) <= {version, version + 1}, r.versions
        assert r.versions == sorted(r.versions), f"versions must not go back: {r.versions}"
    assert held, f"{mode}: the requests finished although the engine was paused"
    assert any(version + 1 in r.versions for r in results), (
        f"{mode}: no token came from the weights loaded during the pause: {[r.versions for r in results]}"
    )
