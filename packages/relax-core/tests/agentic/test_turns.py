"""Multi-turn rollouts through the router with a real tiny HF engine: token in, token out."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoTokenizer

from relax.core.agentic import EpisodeLimits, NoToolCalls, ObservationRenderer, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.protocols import SamplingParams, StepResult, ToolCall, Turn
from relax.core.quickstart_model import build_tiny_model

PROMPT = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


class Recording:
    """An engine wrapper (called like the role in the driver) that keeps every result it returned."""

    def __init__(self, engine):
        self.engine, self.results = engine, {}

    def generate(self, requests):
        results = asyncio.run(self.engine.generate(requests))
        for req, res in zip(requests, results, strict=True):
            self.results[req.request_id] = (list(req.prompt_ids), res)
        return results


class Echo:
    """Answers each turn with a user message naming the turn; done after ``turns`` turns with reward =
    the number of turns; ``fail`` makes the given turn raise / hang / flood."""

    def __init__(self, turns=3, fail=None, flood=0):
        self.turns, self.fail, self.flood, self.closed = turns, fail, flood, 0

    def start(self, sample):
        env = self

        class Episode:
            def step(self, turn: Turn) -> StepResult:
                if env.fail == ("raise", turn.index):
                    raise RuntimeError("tool exploded")
                if env.fail == ("hang", turn.index):
                    time.sleep(30)
                if turn.index + 1 >= env.turns:
                    return StepResult(done=True, reward=float(turn.index + 1), info={"tool_errors": 0})
                text = "9" * env.flood if env.flood else f"{turn.index}+1"
                return StepResult([{"role": "user", "content": text}])

            def close(self):
                env.closed += 1

        return Episode()


def _turns(env, tokenizer, model_dir, **limits):
    limits = EpisodeLimits(**{"max_turns": 4, "max_total_tokens": 200, "turn_timeout_s": 5.0, **limits})
    return Turns(env, NoToolCalls(), tokenizer, limits, stop_token_ids(tokenizer))


def _rollout(model_dir, tokenizer, turns, groups=2, size=2, max_new_tokens=6):
    recording = Recording(HFRolloutEngine(model_dir))
    router = EngineRouter([LocalHandle(recording)])
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    samples = [
        [Sample(prompt_ids=list(prompt), group_id=g, index_in_group=i) for i in range(size)]
        for g in range(groups)
    ]
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    finished = [
        g
        for done, _ in stream_groups(router, samples, params, seed=3, step=1, timeout_s=60, turns=turns)
        for g in done
    ]
    return samples, finished, recording


def test_observation_tokens_continue_the_chat_template(tokenizer):
    renderer = ObservationRenderer(tokenizer)
    after_eos = renderer.text([{"role": "user", "content": "7"}], ended_with="<|im_end|>")
    assert after_eos == "\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by length is closed first, as the template closes an assistant message
    assert renderer.text([{"role": "user", "content": "7"}], ended_with=None).startswith(
        "<|im_end|>\n<|im_start|>user"
    )
    conversation = [
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "7"},
    ]
    whole = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert whole.endswith("7<|im_end|>" + after_eos)  # the continuation is what the template writes


def test_trajectory_is_sampled_tokens_plus_observation_tokens_exactly(model_dir, tokenizer):
    env = Echo(turns=3)
    samples, finished, recording = _rollout(model_dir, tokenizer, _turns(env, tokenizer, model_dir))
    assert sorted(s.group_id for g in finished for s in g[:1]) == [0, 1]  # every group yielded once
    renderer = ObservationRenderer(tokenizer)
    stops = set(stop_token_ids(tokenizer))
    for sample in (s for g in samples for s in g):
        key = f"1/{sample.group_id}/{sample.index_in_group}"
        turns = [recording.results[f"{key}/t{t}"] for t in range(3)]
        expected, mask, logprobs = [], [], []
        for t, (prompt, result) in enumerate(turns):
            assert prompt == sample.prompt_ids + expected  # each turn continues the exact token prefix
            expected += result.response_ids
            mask += [1.0] * len(result.response_ids)
            logprobs += result.logprobs
            if t < 2:  # observation after turns 0 and 1, rendered from the template, never re-tokenised
                last = result.response_ids[-1]
                obs = renderer.ids(
                    [{"role": "user", "content": f"{t}+1"}],
                    tokenizer.decode([last]) if last in stops else None,
                )
                expected += obs
                mask += [0.0] * len(obs)
                logprobs += [0.0] * len(obs)
        assert sample.response_ids == expected
        assert sample.loss_mask == mask and sample.rollout_logprobs == logprobs
        assert len(sample.versions) == len(expected)
        assert sample.metadata["episode"]["turns"] == 3 and sample.metadata["episode_reward"] == 3.0
        assert sample.metadata["episode"]["observation_tokens"] == mask.count(0.0) > 0
    assert env.closed == 4


def test_trainer_logprobs_equal_the_engines_on_sampled_tokens(model_dir, tokenizer):
    from relax.core.trainers.torch_trainer import TorchTrainer

    samples, _, recording = _rollout(model_dir, tokenizer, _turns(Echo(turns=3), tokenizer, model_dir))
    flat = [s for g in samples for s in g]
    batch = collate(flat, pad_id=tokenizer.pad_token_id)
    trained = TorchTrainer(model_dir, micro_batch_size=4).forward_logprobs(batch)
    mask = batch["response_mask"].bool()
    assert (~mask & batch["attention_mask"][:, -mask.shape[1] :].bool()).any(), "precondition: interior holes"
    torch.testing.assert_close(trained[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)
    assert trained[mask].min() < -0.5


@pytest.mark.parametrize("failure", ["raise", "hang"])
def test_a_failing_or_hanging_episode_ends_counted_and_loses_no_group(model_dir, tokenizer, failure):
    env = Echo(turns=3, fail=(failure, 1))
    started = time.monotonic()
    samples, finished, _ = _rollout(
        model_dir, tokenizer, _turns(env, tokenizer, model_dir, turn_timeout_s=1.0)
    )
    assert time.monotonic() - started < 25  # the hang is cut at turn_timeout_s, not waited out
    assert len(finished) == 2
    for s in (s for g in samples for s in g):
        stats = s.metadata["episode"]
        assert stats["turns"] == 2 and stats["errors" if failure == "raise" else "timeouts"] == 1
        assert s.metadata["episode_reward"] is None
        assert ("tool exploded" if failure == "raise" else "turn_timeout_s") in s.metadata["episode_error"]


def test_limits_truncate_and_huge_observations_are_cut(model_dir, tokenizer):
    samples, _, _ = _rollout(
        model_dir,
        tokenizer,
        _turns(Echo(turns=10, flood=500), tokenizer, model_dir, max_turns=2, max_observation_tokens=20),
    )
    for s in (s for g in samples for s in g):
        stats = s.metadata["episode"]
        assert stats["turns"] == 2 and stats["truncated"] == 1 and stats["observations_cut"] == 1
        assert stats["observation_tokens"] == 20 and len(s.response_ids) <= 200
    samples, _, _ = _rollout(
        model_dir, tokenizer, _turns(Echo(turns=10), tokenizer, model_dir, max_total_tokens=20)
    )
    for s in (s for g in samples for s in g):
        assert len(s.response_ids) <= 20 and s.metadata["episode"]["truncated"] == 1


def test_on_tool_error_end_stops_at_a_malformed_call(model_dir, tokenizer):
    class Malformed(NoToolCalls):
        def parse(self, text):
            return text, [ToolCall("", error="could not parse", raw=text)]

    limits = EpisodeLimits(max_turns=4, max_total_tokens=200, turn_timeout_s=5.0, on_tool_error="end")
    turns = Turns(Echo(turns=3), Malformed(), tokenizer, limits, stop_token_ids(tokenizer))
    samples, _, _ = _rollout(model_dir, tokenizer, turns)
    for s in (s for g in samples for s in g):
        assert s.metadata["episode"]["turns"] == 1 and s.metadata["episode"]["malformed_tool_calls"] == 1


def test_environment_reward_scores_the_episode():
    from relax.core.rewards.environment import EnvironmentReward

    sample = Sample(prompt_ids=[1], group_id=0, metadata={"episode": {"turns": 2.0}, "episode_reward": 0.5})
    assert asyncio.run(EnvironmentReward().score(sample)) == 0.5
    sample.metadata["episode_reward"] = None
    assert asyncio.run(EnvironmentReward(missing_score=-1.0).score(sample)) == -1.0
    with pytest.raises(ValueError, match="environment.name"):
        asyncio.run(EnvironmentReward().score(Sample(prompt_ids=[1], group_id=0)))


def test_an_episodes_turns_stay_on_the_engine_holding_its_prefix(model_dir, tokenizer):
    """Next turns go back to the engine that served the previous one (its prefix cache / radix cache)."""
    engines = [Recording(HFRolloutEngine(model_dir)) for _ in range(2)]
    router = EngineRouter([LocalHandle(e) for e in engines])
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    groups = [
        [Sample(prompt_ids=list(prompt), group_id=g, index_in_group=i) for i in range(2)] for g in range(4)
    ]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    list(
        stream_groups(
            router,
            groups,
            params,
            seed=3,
            step=1,
            timeout_s=60,
            turns=_turns(Echo(turns=3), tokenizer, model_dir),
        )
    )
    assert all(e.results for e in engines)  # both engines served episodes
    for sample in (s for g in groups for s in g):
        key = f"1/{sample.group_id}/{sample.index_in_group}"
        served = {i for i, e in enumerate(engines) for t in range(3) if f"{key}/t{t}" in e.results}
        assert len(served) == 1, (key, served)
