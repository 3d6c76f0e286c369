"""Partial rollout on real engine actors: a weight update lands while sequences are being generated."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from relax.core.config import load_config
from relax.core.controller.contexts import engine_context
from relax.core.controller.roles import RolloutRole
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.protocols import SamplingParams
from relax.core.quickstart_model import ensure_quickstart_model

TOKENS = 300


def _groups(n_groups: int = 2, size: int = 2) -> list[list[Sample]]:
    return [
        [Sample(prompt_ids=[5, 6, 7], group_id=g, index_in_group=i) for i in range(size)]
        for g in range(n_groups)
    ]


def _wait_until_generating(engine) -> None:
    deadline = time.monotonic() + 60
    while ray.get(engine.health.remote())["in_flight"] == 0:
        assert time.monotonic() < deadline, "engine never started generating"
        time.sleep(0.01)
    time.sleep(0.2)  # a few tokens in


@pytest.fixture(scope="module")
def engine(ray_session):
    cfg = load_config(None, [])
    handle = RolloutRole.options(max_concurrency=4).remote(
        cfg, engine_context(cfg, ensure_quickstart_model(), 0)
    )
    yield handle
    ray.kill(handle)


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_update_mid_generation(engine, mode):
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    router = EngineRouter([engine])
    groups = _groups()
    base_version = ray.get(engine.weight_version.remote())
    new_version = base_version + 1
    weights = list(load_file(str(Path(ensure_quickstart_model()) / "model.safetensors")).items())
    collected: list = []
    resubmitted = []

    def consume() -> None:
        for finished, n_aborted in stream_groups(
            router, groups, params, seed=0, step=1, timeout_s=120, chunks_per_engine=1
        ):
            collected.extend(finished)
            resubmitted.append(n_aborted)

    worker = threading.Thread(target=consume)
    worker.start()
    _wait_until_generating(engine)
    ray.get(engine.pause.remote())
    if mode == "abort":
        ray.get(engine.call.remote("abort"))
    ray.get(engine.update_weights.remote(weights, new_version))
    ray.get(engine.resume.remote())
    worker.join(timeout=120)
    assert not worker.is_alive()
    samples = [s for g in collected for s in g]
    assert len(samples) == 4 and all(len(s.response_ids) == TOKENS for s in samples)
    if mode == "in_place":
        for s in samples:  # tokens before the update carry the old version, after it the new one
            assert s.versions[0] == base_version and s.versions[-1] == new_version
            assert s.versions == sorted(s.versions)
        assert sum(resubmitted) == 0
    else:  # aborted requests were regenerated from scratch with the new weights only
        assert sum(resubmitted) == 4
        assert all(set(s.versions) == {new_version} for s in samples)
