"""Trainer-hosted engine (``rollout.host=trainer``): it samples from the trainer's own module, its
logprobs equal the trainer's, a sync publishes the version only, and a missed sync is caught."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.hosted import HostedHFEngine, StaleWeightsError
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.quickstart_model import build_tiny_model
from relax.core.trainers.torch_trainer import TorchTrainer
from relax.core.weight_sync.base import WeightSyncError
from relax.core.weight_sync.hosted import HostedSync

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


def generate(engine, temperature=1.0, n=2, seed=7, max_new_tokens=8):
    requests = [
        GenerationRequest(
            f"r{i}", p, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
        )
        for i, p in enumerate(PROMPTS * n)
    ]
    return asyncio.run(engine.generate(requests))


def train_once(trainer, engine):
    results = generate(engine)
    samples = [
        Sample(prompt_ids=p, group_id=i % 3, response_ids=r.response_ids, rollout_logprobs=r.logprobs)
        for i, (p, r) in enumerate(zip(PROMPTS * 2, results, strict=True))
    ]
    batch = collate(samples, pad_id=engine.pad_token_id)
    batch["old_logprobs"] = trainer.forward_logprobs(batch)
    batch["advantages"] = (
        torch.linspace(-1, 1, len(samples))[:, None].expand_as(batch["old_logprobs"]).contiguous()
    )
    return trainer.train_step(batch)


@pytest.fixture
def hosted(model_dir):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig

    trainer = TorchTrainer(
        model_dir, lr=1e-2, micro_batch_size=8, objective=build_policy_objective(AlgorithmConfig())
    )
    return trainer, HostedHFEngine(trainer.model, trainer.tokenizer, model_path=model_dir, seed=3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_like_a_separate_engine_and_logprobs_match_the_trainer(model_dir, temperature):
    trainer = TorchTrainer(model_dir, micro_batch_size=8, temperature=temperature)
    engine = HostedHFEngine(trainer.model, trainer.tokenizer, model_path=model_dir)
    assert engine.model is trainer.model  # no second copy
    results = generate(engine, temperature)
    separate = generate(HFRolloutEngine(model_dir), temperature)
    assert [r.response_ids for r in results] == [r.response_ids for r in separate]
    samples = [
        Sample(prompt_ids=p, group_id=0, response_ids=r.response_ids, rollout_logprobs=r.logprobs)
        for p, r in zip(PROMPTS * 2, results, strict=True)
    ]
    batch = collate(samples, pad_id=engine.pad_token_id)
    mask = batch["response_mask"].bool()
    trained = trainer.forward_logprobs(batch)
    torch.testing.assert_close(trained[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)
    assert trained[mask].min() < -1.0  # not vacuous


def test_sync_publishes_the_version_and_engine_weights_are_the_trainers(hosted):
    trainer, engine = hosted
    sync = HostedSync(timeout_s=5)
    for version in (1, 2):
        before = trainer.model.model.norm.weight.detach().clone()
        train_once(trainer, engine)
        assert not torch.equal(before, trainer.model.model.norm.weight)  # the step changed the weights
        stats = sync.sync(trainer, [engine], version)
        assert engine.weight_version() == version and stats["bytes"] == 0.0
        served = engine.state_dict()
        for name, tensor in trainer.model.state_dict().items():
            assert torch.equal(served[name], tensor), name
        assert all(v == version for r in generate(engine) for v in r.versions)
    assert not len(engine._batch) and not engine._prefixes  # no KV cache held between calls


def test_a_missed_sync_is_caught(hosted):
    trainer, engine = hosted
    train_once(trainer, engine)  # the weights change; version 1 is never published
    with pytest.raises(StaleWeightsError, match="missed weight sync"):
        generate(engine)
    HostedSync(timeout_s=5).sync(trainer, [engine], 1)
    assert generate(engine)[0].versions[0] == 1


def test_generates_in_eval_mode_and_restores_the_trainers_mode(hosted):
    trainer, engine = hosted
    trainer.model.train()
    seen = []
    handle = trainer.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        generate(engine, n=1, max_new_tokens=2)
    finally:
        handle.remove()
    assert seen and not any(seen)
    assert trainer.model.training


def test_sync_refuses_an_engine_the_trainer_does_not_host_and_copies(hosted, model_dir):
    trainer, engine = hosted
    with pytest.raises(WeightSyncError, match="not hosted by the trainer"):
        HostedSync(timeout_s=5).sync(trainer, [engine, HFRolloutEngine(model_dir)], 1)
    with pytest.raises(StaleWeightsError, match="rollout.host=separate"):
        engine.update_weights(trainer.model.state_dict().items(), 1)
