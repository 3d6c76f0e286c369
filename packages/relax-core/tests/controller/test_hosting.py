"""``rollout.host``: when the engine runs inside the trainer's actor, and that actor as both roles
(one process, one model): generate, train, a version-only sync, and a missed sync refused."""

from __future__ import annotations

import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.contexts import engine_context, trainer_context
from relax.core.controller.hosting import host_problems, hosts_engine
from relax.core.controller.roles import HostRole
from relax.core.data import Sample, collate
from relax.core.engines.hosted import StaleWeightsError
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import ensure_quickstart_model
from relax.core.weight_sync.hosted import HostedSync

pytestmark = pytest.mark.timeout(600)
PROMPT = [1, 2, 3, 4, 5]


def test_the_quickstart_hosts_its_engine_and_other_setups_do_not():
    assert hosts_engine(load_config(None)) and not hosts_engine(load_config(None, ["rollout.host=separate"]))
    cases = {
        "mode=async": "mode is 'async'",
        "rollout.num_engines=2": "rollout.num_engines is 2",
        "trainer.backend_params={world_size: 2}": "world_size is 2",
        "rollout.engine_params={device: meta}": "rollout.engine_params.device 'meta'",
    }
    for override, problem in cases.items():
        extra = ["max_staleness=1"] if override == "mode=async" else []
        cfg = load_config(None, [override, *extra])
        assert any(problem in p for p in host_problems(cfg)), (override, host_problems(cfg))
        assert not hosts_engine(cfg)  # auto: a separate engine
        with pytest.raises(ValueError, match=r"rollout.host: 'trainer' is not possible here: .*" + problem):
            hosts_engine(load_config(None, [override, *extra, "rollout.host=trainer"]))


def _generate(handle, seed: int = 7):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, seed=seed)
    return ray.get(handle.generate.remote([GenerationRequest("r", PROMPT, params)]))[0]


def _train(handle, response) -> None:
    batch = collate([Sample(prompt_ids=PROMPT, group_id=0, response_ids=response.response_ids)], 0)
    batch["old_logprobs"] = ray.get(handle.forward_logprobs.remote(batch))
    batch["advantages"] = torch.ones_like(batch["response_mask"])
    ray.get(handle.train_step.remote(batch))


def test_one_actor_trains_serves_and_publishes_versions(ray_session):
    cfg = load_config(None, ["trainer.lr=0.05"])
    path = ensure_quickstart_model()
    handle = HostRole.options(num_cpus=0, max_concurrency=4).remote(
        cfg, trainer_context(cfg, path), engine_context(cfg, path, 0), num_threads=1
    )
    try:
        caps = ray.get(handle.capabilities.remote())
        assert {"end_weight_update", "save_hf", "abort"} <= set(caps)  # trainer's and engine's
        first = _generate(handle)
        assert set(first.versions) == {0}
        sync = HostedSync(timeout_s=30)
        for version in (1, 2):
            _train(handle, first)
            assert sync.sync(handle, [handle], version)["bytes"] == 0.0
            assert ray.get(handle.weight_version.remote()) == version
            assert ray.get(handle.health.remote())["weight_version"] == version
            same = ray.get(
                handle.__ray_call__.remote(
                    lambda self: all(
                        torch.equal(t, self.trainer.model.state_dict()[n])
                        for n, t in self.engine.state_dict().items()
                    )
                )
            )
            assert same
            assert set(_generate(handle).versions) == {version}
        assert _generate(handle).logprobs != first.logprobs  # it samples from the trained weights
        _train(handle, first)  # version 3 never published: a missed sync
        with pytest.raises(StaleWeightsError, match="missed weight sync"):
            _generate(handle)
    finally:
        ray.kill(handle)


def test_a_builtin_rule_reward_is_scored_in_the_driver_like_the_role():
    from relax.core.controller.contexts import reward_context
    from relax.core.controller.driver_reward import start_reward
    from relax.core.controller.local import LocalHandle, get

    cfg = load_config(None, ["reward.params={mode: first}"])
    reward = start_reward(cfg, reward_context(cfg, None))
    assert isinstance(reward, LocalHandle)
    samples = [
        Sample(prompt_ids=[1], group_id=0, response_ids=[2], response_text=text, label="7")
        for text in ("7", "the answer is 8")
    ]
    scored, counts = get(reward.score.remote(samples))
    assert [s.reward for s in scored] == [1.0, 0.0]
    assert counts["failures"] == 0.0 and counts["timeouts"] == 0.0


def test_the_hosted_trainer_leaves_a_core_to_the_driver():
    from relax.core.controller.hosting import host_threads

    assert [host_threads(c) for c in (1, 2, 16)] == [1, 1, 15]
