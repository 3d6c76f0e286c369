"""``router: sglang``: one engine fronts two SGLang servers with an sglang-router (the session's shared
server and one more), instead of core's router balancing one-server engines. Generation through the router
equals core's HF engine; a ``sglang_distributed`` sync (every server joins one group, each its own ranks)
makes *both* servers serve the new weights at the new version. Skips when no interpreter has the
sglang-router package (``RELAX_SGLANG_ROUTER_PYTHON``, this one, or the server env's)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import requests

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import torch_trainer
from relax.sglang.payload import generate_payload, parse_output
from relax.sglang.testing import load_weights

PROMPTS = [[4, 5, 6], [7, 8, 9, 10], [12, 3], [5, 5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]


def _ids(engine) -> list[list[int]]:
    return [r.response_ids for r in asyncio.run(asyncio.wait_for(engine.generate(_requests()), 300))]


def _served_by(client, version: int) -> list[list[int]]:
    """Greedy tokens of one server, asked directly (not through the router); every token at ``version``."""

    async def each():
        return await asyncio.gather(
            *(client.generate(generate_payload(r, f"{r.request_id}-direct", [])) for r in _requests())
        )

    out = []
    for raw in asyncio.run(asyncio.wait_for(each(), 300)):
        ids, _, versions, _ = parse_output(raw, -1)
        assert versions == [version] * len(ids), versions
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def routed(sglang_engine, tiny_dirs, tmp_path_factory):
    """An engine with ``router: sglang`` over the session's server and a second one launched here."""
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.router import RouterMissing, router_python
    from relax.sglang.server import ServerProcess
    from relax.sglang.testing import engine_params

    params = engine_params(router="sglang")
    try:
        router_python(params, params.python)
    except RouterMissing as exc:
        pytest.skip(f"sglang-router not installed ({exc})")
    run_dir = tmp_path_factory.mktemp("sgl-router")
    second = ServerProcess(params, tiny_dirs[0], "float32", run_dir / "second-server.log", index=7)
    second.start()
    engine = None
    try:
        attached = dataclasses.replace(params, urls=[sglang_engine.url, second.url])
        engine = SGLangEngine(attached, tiny_dirs[0], run_dir=str(run_dir))
        yield engine
    finally:
        if engine is not None:
            engine.close()
        second.stop()
        load_weights(sglang_engine, tiny_dirs[0], sglang_engine.weight_version() + 1)


def test_the_router_fronts_both_servers_and_serves_what_hf_serves(routed, sglang_engine, tiny_dirs):
    workers = requests.get(f"{routed.url}/workers", timeout=30).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(w.url for w in routed.workers) and len(workers) == 2
    assert routed.url not in {w.url for w in routed.workers} and routed.health()["ok"] is True
    assert _ids(routed) == _ids(HFRolloutEngine(tiny_dirs[0]))


def test_a_distributed_sync_reaches_every_server_behind_the_router(routed, tiny_dirs):
    from relax.sglang.transports import SGLangDistributedSync

    want = _ids(HFRolloutEngine(tiny_dirs[1]))
    assert want != _ids(routed)  # the other model answers differently: the check below is not vacuous
    transport = SGLangDistributedSync(timeout_s=120, bucket_bytes=1 << 18, backend="gloo")
    version = routed.weight_version() + 1
    try:
        transport.sync(torch_trainer(tiny_dirs[1]), [routed], version)
        assert routed.weight_version() == version
        for worker in routed.workers:
            assert _served_by(worker, version) == want, f"{worker.name} does not serve the synced weights"
        assert _ids(routed) == want
    finally:
        transport.close()


def test_a_tensor_sync_reaches_every_server_behind_the_router(routed, tiny_dirs):
    """``sglang_tensor`` posts each server its own payload (staged per server rank; on CPU one host copy)."""
    from relax.sglang.transports import SGLangTensorSync

    transport = SGLangTensorSync(timeout_s=120, bucket_bytes=1 << 18)
    try:
        for model_dir in (
            tiny_dirs[1],
            tiny_dirs[0],
        ):  # the other weights (if the test above did not run), then back
            want, version = _ids(HFRolloutEngine(model_dir)), routed.weight_version() + 1
            transport.sync(torch_trainer(model_dir), [routed], version)
            for worker in routed.workers:
                assert _served_by(worker, version) == want, f"{worker.name} does not serve the synced weights"
    finally:
        transport.close()
