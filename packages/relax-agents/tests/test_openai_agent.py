"""``openai_agent``: a plain ``openai``-client agent, run as a Relax rollout through ``Turns`` and the
real router with a real tiny HF engine (token in, token out; every failure bounded)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import openai
import pytest
from transformers import AutoTokenizer

from relax.agents.openai_env import OpenAIAgentEnvironment, OpenAIAgentParams
from relax.core.agentic import EpisodeLimits, ObservationRenderer, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.protocols import SamplingParams, ToolCall
from relax.core.quickstart_model import build_tiny_model

PROMPTS = ["3+4=", "12*3-5=", "7", "99-1="]  # one per group: sessions must not see each other's
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count",
            "description": "length of a text",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    }
]


class CountEveryTurn:
    """A tool parser for the character-level tiny model (it cannot write JSON markup): every turn is
    its text plus one call ``count(text=...)``."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return text, [ToolCall("count", {"text": text})]


def counting_agent(client: openai.OpenAI, row: dict, log: dict, turns: int = 3) -> dict:
    """A tool-calling loop written against the plain OpenAI client; tool results go back as ``role: tool``."""
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = log.setdefault(str(client.base_url), [])
    for _ in range(turns):
        reply = client.chat.completions.create(model="relax", messages=messages, tools=TOOLS, logprobs=True)
        message = reply.choices[0].message
        seen.append(
            {
                "content": message.content or "",
                "usage": reply.usage.completion_tokens,
                "logprobs": [t.logprob for t in reply.choices[0].logprobs.content],
            }
        )
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            text = json.loads(call.function.arguments)["text"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(len(text))})
    return {"reward": float(len(seen)), "agent_turns": float(len(seen))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir)


class Recording:
    """The engine as the router's driver-side role, keeping every (prompt, result) it returned."""

    def __init__(self, engine):
        self.engine, self.results = engine, {}

    def generate(self, requests):
        results = asyncio.run(self.engine.generate(requests))
        for req, res in zip(requests, results, strict=True):
            self.results[req.request_id] = (list(req.prompt_ids), res)
        return results


def rollout(engine, tokenizer, agent_fn, groups=2, size=2, max_turns=4, turn_timeout_s=10.0, **params):
    env = OpenAIAgentEnvironment(OpenAIAgentParams(call_timeout_s=20.0, **params), tokenizer, agent=agent_fn)
    limits = EpisodeLimits(max_turns=max_turns, max_total_tokens=200, turn_timeout_s=turn_timeout_s)
    turns = Turns(env, CountEveryTurn(), tokenizer, limits, stop_token_ids(tokenizer))
    recording = Recording(engine)
    samples = []
    for g in range(groups):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[g]}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        samples.append(
            [Sample(list(ids), g, i, prompt_text=text, metadata={"prompt": PROMPTS[g]}) for i in range(size)]
        )
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tuple(stop_token_ids(tokenizer)))
    router = EngineRouter([LocalHandle(recording)])
    for _ in stream_groups(router, samples, params, seed=3, step=1, timeout_s=60, turns=turns):
        pass
    return env, [s for g in samples for s in g], recording


def test_agent_episodes_are_exactly_sampled_plus_observation_tokens(engine, tokenizer):
    log: dict = {}
    env, samples, recording = rollout(engine, tokenizer, functools.partial(counting_agent, log=log))
    renderer, stops = ObservationRenderer(tokenizer), set(stop_token_ids(tokenizer))
    assert len({env.session_of(s).id for s in samples}) == 4  # one session per episode
    for sample in samples:
        session = env.session_of(sample)
        assert sample.metadata.get("episode_error") is None
        assert sample.metadata["episode_reward"] == 3.0 and sample.metadata["episode"]["agent_turns"] == 3.0
        assert session.messages[0] == {
            "role": "user",
            "content": PROMPTS[sample.group_id],
        }  # its own prompt only
        key = f"1/{sample.group_id}/{sample.index_in_group}"
        expected, mask, logprobs = [], [], []
        for t, record in enumerate(session.records):
            prompt, result = recording.results[f"{key}/t{t}"]
            assert record.prompt_ids == prompt == sample.prompt_ids + expected
            assert record.token_ids == result.response_ids and record.logprobs == result.logprobs
            body = result.response_ids[:-1] if result.response_ids[-1] in stops else result.response_ids
            sampled_text = tokenizer.decode(body, skip_special_tokens=False)
            # the agent saw exactly the sampled text, token counts and logprobs
            assert log[session.base_url + "/"][t] == {
                "content": sampled_text,
                "usage": len(result.response_ids),
                "logprobs": result.logprobs,
            }
            expected += result.response_ids
            mask += [1.0] * len(result.response_ids)
            logprobs += result.logprobs
            if t < 2:  # the agent's tool result, rendered as a template continuation at mask 0
                assert record.observations == [
                    {
                        "role": "tool",
                        "content": str(len(sampled_text)),
                        "tool_call_id": record.tool_calls[0]["id"],
                    }
                ]
                ended = (
                    tokenizer.decode([result.response_ids[-1]]) if result.response_ids[-1] in stops else None
                )
                obs = renderer.ids(record.observations, ended)
                expected += obs
                mask += [0.0] * len(obs)
                logprobs += [0.0] * len(obs)
        assert len(session.records) == 3
        assert (
            sample.response_ids == expected
            and sample.loss_mask == mask
            and sample.rollout_logprobs == logprobs
        )
        assert mask.count(0.0) == sample.metadata["episode"]["observation_tokens"] > 0
    env.close()


def test_models_route_and_bad_requests_answer_at_once(tokenizer):
    env = OpenAIAgentEnvironment(OpenAIAgentParams(model="policy"), tokenizer, agent=lambda client, row: 0.0)
    client = openai.OpenAI(base_url=f"{env.server.url}/v1", api_key="x", max_retries=0, timeout=5)
    assert [m.id for m in client.models.list().data] == ["policy"]
    gone = openai.OpenAI(
        base_url=f"{env.server.url}/s/nosuchsession/v1", api_key="x", max_retries=0, timeout=5
    )
    with pytest.raises(openai.APIStatusError, match="does not exist or has ended") as err:
        gone.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}])
    assert err.value.status_code == 410
    session = env.server.open()
    live = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0, timeout=5)
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        live.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}], stream=True)
    env.close()
    with pytest.raises(openai.APIConnectionError):  # the server is gone once the environment closes
        client.models.list()


def _agent_then(after, log):
    """An agent that makes one good call, then does ``after(client, messages, reply)``."""

    def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="relax", messages=messages)
        try:
            return after(client, [*messages, reply.choices[0].message.model_dump(exclude_none=True)])
        except openai.APIStatusError as exc:
            log.append((exc.status_code, exc.message))
            raise
        finally:
            log.append("ended")

    return agent


def _raise(client, messages):
    raise ValueError("agent exploded")


def _rewrite(client, messages):
    messages[0] = {"role": "user", "content": "1+1="}
    client.chat.completions.create(model="relax", messages=[*messages, {"role": "user", "content": "go"}])


def _assistant(client, messages):
    client.chat.completions.create(model="relax", messages=[*messages, {"role": "assistant", "content": "7"}])


def _forever(client, messages):
    while True:  # the agent never stops; core's max_turns ends the episode
        reply = client.chat.completions.create(
            model="relax", messages=[*messages, {"role": "user", "content": "1"}]
        )
        messages = [
            *messages,
            {"role": "user", "content": "1"},
            reply.choices[0].message.model_dump(exclude_none=True),
        ]


@pytest.mark.parametrize(
    ("after", "error", "http"),
    [
        (_raise, "the agent raised ValueError: agent exploded", None),
        (_rewrite, "rewrites message 0 of the conversation", 400),
        (_assistant, "added an assistant message of its own", 400),
        (
            lambda client, messages: time.sleep(30),
            "did not return within environment.turn_timeout_s=1s",
            None,
        ),
        (_forever, None, 410),
    ],
    ids=["raises", "rewrites-history", "injects-assistant", "hangs", "outlives-the-episode"],
)
def test_a_misbehaving_agent_ends_its_episode_with_a_clear_error(engine, tokenizer, after, error, http):
    log: list = []
    started = time.monotonic()
    env, samples, _ = rollout(
        engine, tokenizer, _agent_then(after, log), groups=1, size=1, max_turns=2, turn_timeout_s=1.0
    )
    (sample,) = samples
    session = env.session_of(sample)
    if error is None:  # ended by core's turn limit: no error, the agent's waiting call is refused
        assert sample.metadata["episode"]["truncated"] == 1 and "episode_error" not in sample.metadata
    else:
        assert error in sample.metadata["episode_error"]
        assert session.id in sample.metadata["episode_error"] or "turn_timeout_s" in error
        assert sample.metadata["episode_reward"] is None
    if http is not None:  # the agent's own call failed too, with the same story
        deadline = time.monotonic() + 5
        while "ended" not in log and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log[0][0] == http and log[-1] == "ended"
        if error is not None:
            assert error in log[0][1]
    assert session.closed and time.monotonic() - started < 15
    env.close()


def test_first_request_must_render_to_the_sample_prompt(engine, tokenizer):
    def agent(client, row):  # a system prompt the dataset row does not have
        client.chat.completions.create(
            model="relax",
            messages=[{"role": "system", "content": "1"}, {"role": "user", "content": row["prompt"]}],
        )

    env, (sample,), _ = rollout(engine, tokenizer, agent, groups=1, size=1)
    message = sample.metadata["episode_error"]
    assert "first request renders to a different prompt than the sample's" in message
    assert "first difference at token 1" in message and env.session_of(sample).id in message
    env.close()


def test_async_agents_and_import_strings(engine, tokenizer, tmp_path, monkeypatch):
    (tmp_path / "my_async_agent.py").write_text(
        "async def agent(client, row, bonus=0.0):\n"
        "    reply = await client.chat.completions.create(model='relax', messages=[{'role': 'user', 'content': row['prompt']}],\n"
        "                                                 extra_body={'return_token_ids': True})\n"
        "    ids = reply.choices[0].model_extra['token_ids'] + reply.model_extra['prompt_token_ids']\n"
        "    return {'reward': len(reply.choices[0].message.content or '') + bonus, 'ids': sum(ids), 'n': len(ids)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env, samples, recording = rollout(
        engine, tokenizer, None, groups=1, size=2, agent="my_async_agent:agent", agent_kwargs={"bonus": 0.5}
    )
    for sample in samples:
        (record,) = env.session_of(sample).records
        assert sample.metadata["episode_reward"] == len(record.content) + 0.5
        ids = record.token_ids + record.prompt_ids  # vLLM's return_token_ids extension: the exact tokens
        assert sample.metadata["episode"]["ids"] == sum(ids) and sample.metadata["episode"]["n"] == len(ids)
    with pytest.raises(ValueError, match="environment.params.agent: cannot import 'my_async_agent:nope'"):
        OpenAIAgentEnvironment(OpenAIAgentParams(agent="my_async_agent:nope"), tokenizer)
    env.close()


def test_no_thread_is_left_waiting_on_a_closed_environment(tokenizer):
    env = OpenAIAgentEnvironment(OpenAIAgentParams(call_timeout_s=30), tokenizer, agent=lambda c, r: 0.0)
    session = env.server.open()
    client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0, timeout=30)
    errors = []

    def call():
        try:
            client.chat.completions.create(model="relax", messages=[{"role": "user", "content": "1"}])
        except openai.APIStatusError as exc:
            errors.append(exc.status_code)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 5
    while session.events.empty() and time.monotonic() < deadline:  # the call waits for a policy turn
        time.sleep(0.02)
    env.close()
    caller.join(5)
    assert not caller.is_alive() and errors == [410]


def test_registered_with_typed_params(model_dir):
    from relax.core.config import build_section
    from relax.core.context import PluginContext
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    errors: list[str] = []
    build_section(
        manager.registration("environment", "openai_agent").config,
        {"agent": "no_colon", "call_timeout_s": 0},
        "environment.params",
        errors,
    )
    assert errors == [
        "environment.params.agent: expected 'module:function', got 'no_colon'",
        "environment.params.call_timeout_s: must be > 0, got 0.0",
    ]
    params = build_section(
        manager.registration("environment", "openai_agent").config,
        {"agent": "json:dumps", "model": "policy"},
        "environment.params",
        errors,
    )
    env = manager.get("environment", "openai_agent")(
        params, PluginContext(role="environment", tokenizer_path=model_dir)
    )
    client = openai.OpenAI(base_url=f"{env.server.url}/v1", api_key="x", max_retries=0, timeout=5)
    assert [m.id for m in client.models.list().data] == ["policy"]
    env.close()
    verifiers = manager.registration("environment", "verifiers").config
    build_section(verifiers, {"env": "", "episode_timeout_s": -1}, "environment.params", errors)
    assert errors[-2:] == [
        "environment.params.env: expected 'module:function', got ''",
        "environment.params.episode_timeout_s: must be > 0, got -1.0",
    ]
