"""Multi-turn continuation on the ``sglang`` engine: each turn is a fresh request whose prompt is the
prompt plus the trajectory so far (``relax.core.agentic.Turns``); SGLang's radix cache serves that prefix.

On CPU the session's shared server runs deterministic inference, with which SGLang disables the radix
cache for the ``torch_native`` attention backend (every turn is prefilled whole): the token continuation
is checked there; that the server reuses the prefix (``meta_info.cached_tokens``) is checked on a GPU
server with SGLang's CUDA defaults (radix cache on), or on any server that reports its radix cache on.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.payload import generate_payload

PROMPT = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 4, 5, 6]
TURNS = (4, 3, 5)  # tokens per turn; one request of their sum is the reference


def _run(coro, timeout_s: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)


def continued_turn_by_turn(engine) -> tuple[list[int], list[float], list[dict]]:
    """Greedy turns, each a new request continuing the token prefix; also each turn's raw server reply
    (``meta_info``) for the same body the engine sends."""
    ids, logprobs, metas = [], [], []
    for turn, tokens in enumerate(TURNS):
        req = GenerationRequest(f"mt-{turn}", PROMPT + ids, _greedy(tokens))
        metas.append(
            engine.client.post("/generate", generate_payload(req, f"mt-raw-{turn}", []))["meta_info"]
        )
        result = _run(engine.generate([req]))[0]
        assert result.finish_reason == "length" and len(result.response_ids) == tokens
        ids += result.response_ids
        logprobs += result.logprobs
    return ids, logprobs, metas


def radix_cache_on(engine) -> bool:
    return not engine.client.get("/server_info")["disable_radix_cache"]  # the resolved value, not the flag


def assert_continuation_equals_one_request(engine) -> list[dict]:
    ids, logprobs, metas = continued_turn_by_turn(engine)
    whole = _run(engine.generate([GenerationRequest("mt-whole", PROMPT, _greedy(sum(TURNS)))]))[0]
    assert ids == whole.response_ids, f"turn by turn {ids} vs one request {whole.response_ids}"
    torch.testing.assert_close(logprobs, whole.logprobs, atol=1e-3, rtol=0)
    for turn, meta in enumerate(metas):  # the server counts every prompt token, cached or not
        assert meta["prompt_tokens"] == len(PROMPT) + sum(TURNS[:turn])
    return metas


def assert_prefix_served_from_cache(metas: list[dict]) -> None:
    """Every later turn's prompt (the earlier turns' prompt and response) was in the radix cache."""
    for turn, meta in enumerate(metas[1:], start=1):
        assert meta["cached_tokens"] >= len(PROMPT) + sum(TURNS[: turn - 1]), (turn, meta)


def test_a_trajectory_continued_turn_by_turn_equals_one_request(sglang_engine):
    metas = assert_continuation_equals_one_request(sglang_engine)
    if radix_cache_on(sglang_engine):
        assert_prefix_served_from_cache(metas)
    else:  # what the server says of its radix cache agrees with what it reports per request
        assert [m["cached_tokens"] for m in metas] == [0] * len(TURNS)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
@pytest.mark.skipif(
    not os.environ.get("RELAX_SGLANG_PYTHON"),
    reason="needs RELAX_SGLANG_PYTHON: the python of an environment with CUDA SGLang (README)",
)
def test_radix_cache_serves_each_turns_prefix_on_cuda(tiny_dirs, tmp_path):
    """SGLang's CUDA defaults (fast kernels, radix cache on): later turns report their prefix as cached."""
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.params import SGLangEngineParams

    params = SGLangEngineParams(
        python=os.environ["RELAX_SGLANG_PYTHON"],
        device="cuda",
        dtype="float32",
        deterministic=False,
        mem_fraction_static=0.3,
        startup_timeout_s=900,
    )
    engine = SGLangEngine(params, tiny_dirs[0], run_dir=str(tmp_path / "sglang-radix"))
    try:
        assert radix_cache_on(engine)
        assert_prefix_served_from_cache(assert_continuation_equals_one_request(engine))
    finally:
        engine.close()
