"""Every transport between the real torch trainer and real HF engine actors: the engines end up with
bit-identical weights, serve the new version, and their sampling logprobs follow the new weights."""

from __future__ import annotations

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.roles import RolloutRole, TrainerRole
from relax.core.data import Sample, collate
from relax.core.plugins import get_plugin_manager
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import ensure_quickstart_model

pytestmark = pytest.mark.timeout(300)
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def roles(ray_session):
    cfg = load_config(None, ["trainer.lr=0.01"])
    path = ensure_quickstart_model()
    trainer = TrainerRole.remote(cfg, path)
    engines = [RolloutRole.options(max_concurrency=4).remote(cfg, path, i) for i in range(2)]
    yield cfg, trainer, engines
    for handle in [trainer, *engines]:
        ray.kill(handle)


def _sample(engine, seed: int = 7):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, seed=seed)
    (result,) = ray.get(engine.generate.remote([GenerationRequest("r", PROMPT, params)]))
    return result


def _step_trainer(trainer, cfg) -> None:
    """One real policy-gradient step so the trainer's weights differ from the engines'."""
    sample = Sample(prompt_ids=PROMPT, group_id=0, response_ids=[6, 7, 8, 9], loss_mask=[1.0] * 4)
    batch = collate([sample], 0)
    batch["old_logprobs"] = ray.get(trainer.forward_logprobs.remote(batch))
    batch["advantages"] = torch.ones_like(batch["response_mask"])
    ray.get(trainer.train_step.remote(batch))


@pytest.mark.parametrize("transport", ["in_process", "object_store", "broadcast", "disk"])
def test_transport_updates_real_engines(roles, transport):
    cfg, trainer, engines = roles
    before = _sample(engines[0])
    _step_trainer(trainer, cfg)
    version = ray.get(engines[0].weight_version.remote()) + 1
    sync = get_plugin_manager().get("weight_sync", transport)(timeout_s=60, bucket_bytes=1 << 18)
    stats = sync.sync(trainer, engines, version)
    assert stats["bytes"] > 0 and stats["engines"] == 2
    exported = {n: t for bucket in ray.get(trainer.export_weights.remote(1 << 30)) for n, t in bucket}
    for engine in engines:
        assert ray.get(engine.weight_version.remote()) == version
        served = ray.get(engine.call.remote("state_dict"))
        assert served.keys() >= exported.keys()
        for name, tensor in exported.items():
            assert torch.equal(served[name], tensor), (transport, name)
    after = _sample(engines[1])
    assert after.versions == [version] * 8
    sample = Sample(prompt_ids=PROMPT, group_id=0, response_ids=after.response_ids)
    trainer_lp = ray.get(trainer.forward_logprobs.remote(collate([sample], 0)))[0]
    assert torch.allclose(torch.tensor(after.logprobs), trainer_lp, atol=1e-4)
    if before.response_ids == after.response_ids:
        assert before.logprobs != after.logprobs
