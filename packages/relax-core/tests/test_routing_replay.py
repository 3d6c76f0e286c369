"""MoE routing replay (R3) on a tiny Qwen3-MoE: the HF engine records each token's experts, the samples carry
them compactly through the queue, the torch trainer replays them (relax.core.routing_replay, docs/moe.md)."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
import torch

from relax.core.config import ConfigError, config_from_dict
from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.queue import packing
from relax.core.routing_replay import (
    UNRECORDED,
    RoutingRecorder,
    moe_routers,
    pack_routing,
    replays,
    routing_dtype,
)
from relax.core.testing.moe_models import tiny_moe_dir
from relax.core.trainers.torch_trainer import TorchTrainer

PROMPTS = [[4, 23, 10, 17, 11, 20], [12, 18, 9], [7, 5], [4, 23, 10, 17, 11, 20], [9, 14, 21, 6]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_moe_dir(tmp_path_factory.mktemp("r3") / "moe")


@pytest.fixture(scope="module")
def rollout(moe_dir):
    """The engine's results for PROMPTS (a shared prompt, rows joining a running batch) and their samples."""
    engine = HFRolloutEngine(moe_dir, record_routing=True, max_batch_size=3)
    requests = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=NEW_TOKENS, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    results = asyncio.run(engine.generate(requests))
    samples = [
        Sample(
            prompt_ids=p,
            group_id=i,
            response_ids=r.response_ids,
            rollout_logprobs=r.logprobs,
            routed_experts=r.routed_experts,
        )
        for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True))
    ]
    return results, samples, engine.pad_token_id


@pytest.fixture(scope="module")
def trainer(moe_dir):
    return TorchTrainer(moe_dir, routing_replay=True, lr=1e-3, micro_batch_size=8)


def test_engine_records_every_fed_token_of_prompt_and_response(rollout, trainer):
    from relax.core.controller.samples import apply_result

    results, samples, pad_id = rollout
    assert (
        apply_result(Sample(prompt_ids=PROMPTS[0], group_id=0), results[0]).routed_experts
        is results[0].routed_experts
    )
    for prompt, r in zip(PROMPTS, results, strict=True):
        tokens = len(prompt) + len(r.response_ids)
        assert r.routed_experts.shape == (tokens, 2, 2) and r.routed_experts.dtype == np.int8
        assert (r.routed_experts[-1] == UNRECORDED).all()  # the last sampled token is fed by no forward
        assert ((r.routed_experts[:-1] >= 0) & (r.routed_experts[:-1] < 4)).all()
    # the same experts as the model's own routing over each full sequence, unpadded (same weights)
    recorder = RoutingRecorder(trainer.model)
    try:
        for prompt, r in zip(PROMPTS, results, strict=True):
            ids = torch.tensor([prompt + r.response_ids])
            with torch.no_grad():
                trainer.model(input_ids=ids)
            own = recorder.take(1, ids.shape[1])[0]
            assert (np.sort(own[:-1], -1) == np.sort(r.routed_experts[:-1], -1)).all()
    finally:
        recorder.close()


def test_a_multi_turn_episode_carries_the_routing_of_its_whole_token_sequence(moe_dir, trainer):
    """Each turn's prompt is the episode so far (nothing re-tokenised), so the last turn's routing covers the
    prompt, every turn's sampled tokens and the observations between them."""
    from transformers import AutoTokenizer

    from relax.core.agentic import EpisodeLimits, NoToolCalls, Turns
    from relax.core.controller.local import LocalHandle
    from relax.core.controller.router import EngineRouter, stream_groups
    from relax.core.engines.stop_tokens import stop_token_ids
    from relax.core.protocols import StepResult

    class TwoTurns:
        def start(self, sample):
            class Episode:
                def step(self, turn):
                    return (
                        StepResult(done=True)
                        if turn.index
                        else StepResult([{"role": "user", "content": "1+1"}])
                    )

                def close(self):
                    pass

            return Episode()

    class Engine:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, requests):
            return asyncio.run(self.engine.generate(requests))

    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    stops = tuple(stop_token_ids(tokenizer))
    limits = EpisodeLimits(max_turns=2, max_total_tokens=200, turn_timeout_s=5.0)
    turns = Turns(TwoTurns(), NoToolCalls(), tokenizer, limits, stops)
    router = EngineRouter([LocalHandle(Engine(HFRolloutEngine(moe_dir, record_routing=True)))])
    samples = [[Sample(prompt_ids=list(PROMPTS[0]), group_id=0)]]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=stops)
    list(stream_groups(router, samples, params, seed=3, step=1, timeout_s=60, turns=turns))
    sample = samples[0][0]
    assert 0.0 in sample.loss_mask  # an observation between the turns
    ids = sample.prompt_ids + sample.response_ids
    assert sample.routed_experts.shape == (len(ids), 2, 2)
    recorder = RoutingRecorder(trainer.model)
    try:
        with torch.no_grad():
            trainer.model(input_ids=torch.tensor([ids]))
        own = recorder.take(1, len(ids))[0]
    finally:
        recorder.close()
    assert (np.sort(own[:-1], -1) == np.sort(sample.routed_experts[:-1], -1)).all()


def test_collate_aligns_routing_with_left_padded_prompts():
    a = np.arange(2 * 3 * 1, dtype=np.int8).reshape(3, 1, 2)  # 2 prompt + 1 response tokens
    b = np.full((5, 1, 2), 7, dtype=np.int8)  # 3 prompt + 2 response tokens
    packed = pack_routing([a, b, None], [2, 3, 1], p_len=3, r_len=2)
    assert packed.shape == (3, 5, 1, 2) and packed.dtype == torch.int8  # the samples' own compact dtype
    assert (
        (packed[0, 0] == UNRECORDED).all()
        and (packed[0, 1:4].numpy() == a).all()
        and (packed[0, 4] == UNRECORDED).all()
    )
    assert (packed[1].numpy() == 7).all() and (packed[2] == UNRECORDED).all()
    assert pack_routing([None, None], [1, 1], 1, 1) is None


def _perturbed_routers(model, scale: float, seed: int = 0) -> list[torch.Tensor]:
    """Add seeded noise to every router's weight (as a weight sync in another precision would); the originals."""
    gen = torch.Generator().manual_seed(seed)
    originals = [r.weight.detach().clone() for r in moe_routers(model)]
    with torch.no_grad():
        for router, w in zip(moe_routers(model), originals, strict=True):
            router.weight.add_(scale * w.std() * torch.randn(w.shape, generator=gen))
    return originals


def _restore(model, originals) -> None:
    with torch.no_grad():
        for router, w in zip(moe_routers(model), originals, strict=True):
            router.weight.copy_(w)


def test_replay_makes_trainer_logprobs_match_the_engines_under_perturbed_routers(rollout, trainer):
    _, samples, pad_id = rollout
    batch = collate(samples, pad_id)
    mask = batch["response_mask"] > 0
    routing = trainer.response_logits.routing

    def diff(replay: bool) -> tuple[float, float]:
        routing.replay = replay
        lp = trainer.forward_logprobs(batch)
        return float((lp - batch["rollout_logprobs"]).abs()[mask].max()), routing.mismatch()

    try:
        exact, mismatch = diff(True)  # same weights: replay changes nothing
        assert exact < 1e-4 and mismatch == 0.0
        originals = _perturbed_routers(trainer.model, scale=0.02)
        try:
            replayed, mismatch_replayed = diff(True)
            free, mismatch_free = diff(False)
        finally:
            _restore(trainer.model, originals)
    finally:
        routing.replay = True
    assert mismatch_free > 0  # the perturbation moved some tokens to other experts
    assert free > 0.5, free  # ... and their logprobs far from the engine's
    assert replayed < 0.2 and replayed < free / 5, (replayed, free)


def test_the_fsdp_trainer_replays_too(rollout, moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    _perturbed_routers(model, scale=0.02)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(moe_dir).save_pretrained(tmp_path)
    _, samples, pad_id = rollout
    batch = collate(samples, pad_id)
    mask = batch["response_mask"] > 0
    trainer = FSDPTrainer(
        str(tmp_path), objective=build_policy_objective(AlgorithmConfig()), routing_replay=True
    )
    try:
        replayed = float((trainer.forward_logprobs(batch) - batch["rollout_logprobs"]).abs()[mask].max())
        trainer.response_logits.routing.replay = False
        free = float((trainer.forward_logprobs(batch) - batch["rollout_logprobs"]).abs()[mask].max())
    finally:
        trainer.close()
    assert free > 0.5 and replayed < 0.2 and replayed < free / 5, (replayed, free)


def test_train_step_reports_routing_mismatch_with_and_without_replay(rollout, moe_dir):
    _, samples, pad_id = rollout
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig

    trainer = TorchTrainer(
        moe_dir,
        routing_replay=True,
        lr=1e-3,
        micro_batch_size=8,
        objective=build_policy_objective(AlgorithmConfig()),
    )
    _perturbed_routers(trainer.model, scale=0.02)
    batch = collate(samples, pad_id)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    metrics = trainer.train_step(batch)
    assert metrics["routing/mismatch_frac_free"] > 0
    assert metrics["routing/logprob_diff_replay"] < metrics["routing/logprob_diff_free"]
    assert 0 <= metrics["routing/mismatch_frac_replay"] <= 1
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_queue_carries_a_1000_sample_batch_routing_compactly():
    """The routing rides the queue's wire format (one pickle blob, ``queue.packing``) as the raw int8 bytes:
    < 5 % over the arrays themselves (a list of Python ints would cost several times the array)."""
    gen = np.random.default_rng(0)
    layers, k, experts = 48, 8, 128  # a Qwen3-30B-A3B-sized routing
    samples = []
    for i in range(1000):
        p, r = int(gen.integers(20, 60)), int(gen.integers(30, 120))
        samples.append(
            Sample(
                prompt_ids=gen.integers(0, 150_000, p).tolist(),
                group_id=i // 8,
                response_ids=gen.integers(0, 150_000, r).tolist(),
                rollout_logprobs=(-gen.random(r)).tolist(),
                versions=[3] * r,
                loss_mask=[1.0] * r,
            )
        )
    plain = len(packing.encode(samples, may_hold_refs=False)[0])
    routing_bytes = 0
    for s in samples:
        s.routed_experts = gen.integers(
            0, experts, (len(s.prompt_ids) + len(s.response_ids), layers, k), dtype=np.int8
        )
        routing_bytes += s.routed_experts.nbytes
    carried = len(packing.encode(samples, may_hold_refs=False)[0]) - plain
    assert routing_bytes <= carried < 1.05 * routing_bytes, (carried, routing_bytes)
    one = samples[0].routed_experts
    assert len(pickle.dumps(one.tolist())) > 2 * one.nbytes  # what the compact array saves


def test_expert_ids_take_the_narrowest_integer():
    assert [routing_dtype(n) for n in (4, 128, 129, 32768, 32769)] == [
        np.int8,
        np.int8,
        np.int16,
        np.int16,
        np.int32,
    ]


def test_routing_replay_config_field_validates():
    assert (
        config_from_dict({"algorithm": {"routing_replay": "reference"}}).algorithm.routing_replay
        == "reference"
    )
    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": {"routing_replay": "always"}})
    assert (
        "algorithm.routing_replay: 'always' is not allowed; allowed values: 'off', 'rollout', 'reference'"
        in str(err.value)
    )
    # which forwards replay: the policy in both modes, the reference model only in "reference"
    assert [replays(m, True) for m in ("off", "rollout", "reference")] == [False, True, True]
    assert [replays(m, False) for m in ("off", "rollout", "reference")] == [False, False, True]
    # ... as the trainer factories read it from the run (a distillation teacher is another model: never)
    from relax.core.controller.contexts import trainer_context
    from relax.core.policy_update import UpdateSettings

    cfg = config_from_dict({"algorithm": {"routing_replay": "rollout"}})
    roles = ("trainer", "reference", "teacher")
    assert [UpdateSettings.from_context(trainer_context(cfg, "m", role=r)).routing_replay for r in roles] == [
        True,
        False,
        False,
    ]
    cfg = config_from_dict({"algorithm": {"routing_replay": "reference"}})
    assert [UpdateSettings.from_context(trainer_context(cfg, "m", role=r)).routing_replay for r in roles] == [
        True,
        True,
        False,
    ]


def test_recording_on_a_dense_model_is_refused_naming_the_setting(tmp_path):
    from relax.core.testing.models import tiny_model_dir

    with pytest.raises(ValueError, match="algorithm.routing_replay: off"):
        HFRolloutEngine(tiny_model_dir(tmp_path), record_routing=True)
