"""The ``verifiers`` adapter: a small verifiers.v1 environment (taskset, in-process tool-calling harness,
``@vf.reward`` rubric) exported as a Relax dataset and run as Relax rollouts with a real tiny HF engine."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
from transformers import AutoTokenizer

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")

from openai import AsyncOpenAI  # noqa: E402

from relax.agents.verifiers_env import VerifiersEnvironment, VerifiersParams, export_dataset, load_env, main  # noqa: E402
from relax.core.agentic import EpisodeLimits, ObservationRenderer, Turns  # noqa: E402
from relax.core.controller.local import LocalHandle  # noqa: E402
from relax.core.controller.router import EngineRouter, stream_groups  # noqa: E402
from relax.core.data import Sample  # noqa: E402
from relax.core.dataset import DatasetConfig, PromptDataset  # noqa: E402
from relax.core.engines.hf import HFRolloutEngine  # noqa: E402
from relax.core.engines.stop_tokens import stop_token_ids  # noqa: E402
from relax.core.protocols import SamplingParams, ToolCall  # noqa: E402
from relax.core.quickstart_model import build_tiny_model  # noqa: E402

MODULE = "relax_vf_tiny"  # verifiers resolves tasksets and harnesses by importable module id
TOOLS = [
    {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}
]


class ArithmeticTask(vf.Task):
    @vf.reward
    async def turns(self, task, trace) -> float:  # the rubric: model turns, plus half a point per tool result
        return len(trace.assistant_messages) + 0.5 * len(trace.tool_messages)

    @vf.metric
    async def last_reply_chars(self, task, trace) -> float:
        return float(len(trace.last_reply))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask]):
    def load(self):
        for i, prompt in enumerate(["3+4=", "12*3="]):
            yield ArithmeticTask(vf.TaskData(prompt=prompt, system_prompt=f"{i}"), self.config.task)


class CountingHarness(vf.Harness[vf.HarnessConfig]):
    """Runs its loop in-process (verifiers allows it when every model call goes through ``endpoint``):
    one tool round, then a final answer."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for turn in range(2):
                if turn and self.config.env.get("FAIL"):
                    raise RuntimeError("harness exploded")
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(len(messages))})
        from verifiers.v1.runtimes import ProgramResult

        return ProgramResult(exit_code=0, stdout="", stderr="")


def make_env(fail: bool = False):
    harness = {"id": MODULE, "env": {"FAIL": "1"} if fail else {}}
    config = {
        "taskset": {"id": MODULE},
        "agent": {"harness": harness, "runtime": {"type": "subprocess"}},
        "interception": {"type": "server"},
    }
    return vf.SingleAgentEnvConfig.model_validate(config)


class CountEveryTurn:
    """Tool parser for the character-level tiny model: every turn is its text plus one ``count()`` call."""

    def parse(self, text):
        return text, [ToolCall("count", {})]


@pytest.fixture(scope="module")
def vf_module():
    module = types.ModuleType(MODULE)
    module.ArithmeticTaskset, module.CountingHarness, module.make_env = (
        ArithmeticTaskset,
        CountingHarness,
        make_env,
    )
    module.__all__ = ["ArithmeticTaskset", "CountingHarness"]
    sys.modules[MODULE] = module
    yield module
    del sys.modules[MODULE]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


def rollout(env, model_dir, samples, tokenizer):
    relax_env = VerifiersEnvironment(
        VerifiersParams(call_timeout_s=30, episode_timeout_s=60), tokenizer, env=env
    )
    turns = Turns(
        relax_env,
        CountEveryTurn(),
        tokenizer,
        EpisodeLimits(max_turns=4, max_total_tokens=200, turn_timeout_s=30),
        stop_token_ids(tokenizer),
    )
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    router = EngineRouter([LocalHandle(_Engine(HFRolloutEngine(model_dir)))])
    for _ in stream_groups(
        router, [[s] for s in samples], params, seed=5, step=1, timeout_s=120, turns=turns
    ):
        pass
    return relax_env


def dataset_samples(env, tokenizer, path):
    """The environment's tasks as a Relax dataset (export, then core's own loader renders the prompts)."""
    assert export_dataset(env, path) == 2
    config = DatasetConfig(path=str(path), metadata_keys=["vf_task"], shuffle=False, batch_size=2)
    return [
        Sample(it.prompt_ids, g, 0, prompt_text=it.prompt_text, label=it.label, metadata=it.metadata)
        for g, it in enumerate(PromptDataset(config, tokenizer).items)
    ]


def test_a_verifiers_environment_runs_as_relax_rollouts(vf_module, model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = load_env(f"{MODULE}:make_env")
    samples = dataset_samples(env, tokenizer, tmp_path / "tasks.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert rows[1]["prompt"] == [{"role": "system", "content": "1"}, {"role": "user", "content": "12*3="}]
    relax_env = rollout(env, model_dir, samples, tokenizer)

    renderer, stops = ObservationRenderer(tokenizer), set(stop_token_ids(tokenizer))
    for sample in samples:
        session = relax_env.session_of(sample)
        assert sample.metadata.get("episode_error") is None, sample.metadata.get("episode_error")
        first, last = session.records
        assert session.messages[0] == {"role": "system", "content": str(sample.group_id)}  # its own task
        assert sample.metadata["episode_reward"] == 2.5  # the rubric ran on the conversation the policy had
        assert sample.metadata["episode"]["last_reply_chars"] == len(
            last.content
        )  # ... and saw its sampled text
        ended = tokenizer.decode([first.token_ids[-1]]) if first.token_ids[-1] in stops else None
        observation = renderer.ids(first.observations, ended)
        assert first.observations[0]["role"] == "tool"
        assert sample.response_ids == first.token_ids + observation + last.token_ids
        assert sample.loss_mask == [1.0] * len(first.token_ids) + [0.0] * len(observation) + [1.0] * len(
            last.token_ids
        )
        assert sample.rollout_logprobs == first.logprobs + [0.0] * len(observation) + last.logprobs
    relax_env.close()


def test_a_failing_harness_ends_the_episode_with_its_error(vf_module, model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = load_env(f"{MODULE}:make_env", {"fail": True})
    samples = dataset_samples(env, tokenizer, tmp_path / "tasks.jsonl")[:1]
    relax_env = rollout(env, model_dir, samples, tokenizer)
    error = samples[0].metadata["episode_error"]
    assert "verifiers episode failed" in error and "harness exploded" in error
    assert samples[0].metadata["episode_reward"] is None and samples[0].metadata["episode"]["turns"] == 1
    with pytest.raises(ValueError, match="returned dict, not a verifiers.v1 Env or EnvConfig"):
        load_env("json:loads", {"s": "{}"})
    main([f"{MODULE}:make_env", str(tmp_path / "one.jsonl"), "--limit", "1"])  # the export command line
    (row,) = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert row["vf_task"]["prompt"] == "3+4=" and row["label"] is None
    relax_env.close()


class _Engine:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests):
        return asyncio.run(self.engine.generate(requests))
