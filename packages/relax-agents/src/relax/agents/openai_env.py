"""``openai_agent``: agent code written against the OpenAI client runs, unmodified, as a Relax episode.

The agent is ``agent(client, row) -> float | dict | None`` (``async def`` gets an ``AsyncOpenAI``);
``row`` is the dataset row (``prompt``, ``label``, ``metadata``) and the return value its reward
(or ``{"reward": r, ...}``; other numbers become ``episode/<key>`` metrics). The agent runs in a
thread with a client bound to its episode's session of :class:`~relax.agents.openai_server.SessionServer`.

Core samples every policy turn itself (``relax.core.agentic.Turns``); the agent's
``chat.completions.create`` calls only meet those turns. ``Episode.step(turn)`` answers the
pending call with the turn, then waits for the agent: its next call's new messages (tool results,
user turns) are the observations, its return ends the episode. The first call must render to the
sample's prompt tokens and no call may rewrite what came before -- otherwise the trajectory
would not be what the agent saw, and the episode ends with an error that says where they differ.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from relax.agents.openai_server import Call, CallRecord, Session, SessionServer, completion_body
from relax.core.protocols import StepResult, Turn


@dataclass(frozen=True)
class OpenAIAgentParams:
    """``environment.params`` of ``openai_agent``."""

    agent: str = ""  # "module:function", called as agent(client, row, **agent_kwargs)
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str = "relax"  # the model name the endpoint reports
    #: longest an agent's call waits for the policy's turn, and an episode for the agent's next move
    call_timeout_s: float = 600.0
    #: the dataset field the agent gets as row["prompt"] when it is in data.metadata_keys (the raw
    #: message list or string); otherwise row["prompt"] is the rendered prompt text
    prompt_key: str = "prompt"
    check_prompt: bool = True  # the first call's messages must render to the sample's prompt tokens
    keep_sessions: int = 256  # ended sessions kept (with their call records) for inspection

    def validate(self) -> list[str]:
        return check_params(self, "agent", self.agent)


def check_params(params: Any, ref_field: str, ref: str) -> list[str]:
    """Config-time errors shared by ``openai_agent`` and ``verifiers`` (named relative to the section)."""
    errors = (
        []
        if ":" in ref and all(ref.partition(":")[::2])
        else [f"{ref_field}: expected 'module:function', got {ref!r}"]
    )
    if params.call_timeout_s <= 0:
        errors.append(f"call_timeout_s: must be > 0, got {params.call_timeout_s}")
    if params.keep_sessions < 1:
        errors.append(f"keep_sessions: must be >= 1, got {params.keep_sessions}")
    return errors


def import_ref(ref: str, what: str) -> Any:
    """``"package.module:attribute"`` -> the attribute, with an error that names the config field."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"environment.params.{what}: expected 'module:name', got {ref!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment.params.{what}: cannot import {ref!r} ({exc})") from exc


class OpenAIAgentEnvironment:
    """Starts one agent thread and one endpoint session per episode; one server for all of them."""

    def __init__(
        self, params: OpenAIAgentParams, tokenizer: Any, agent: Callable[..., Any] | None = None
    ) -> None:
        self.params, self.tokenizer = params, tokenizer
        self.agent = agent if agent is not None else import_ref(params.agent, "agent")
        if not callable(self.agent):
            raise ValueError(f"environment.params.agent: {params.agent!r} is not callable")
        self.server = SessionServer(params.model, params.call_timeout_s)
        if logging.getLogger("httpx").level == logging.NOTSET:  # the OpenAI client logs every call at INFO
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # recent sessions, oldest first
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self.server.close)

    def start(self, sample: Any) -> AgentEpisode:
        session = self.server.open(sample)
        with self._lock:
            self.sessions[session.id] = session
            while len(self.sessions) > self.params.keep_sessions:
                self.sessions.popitem(last=False)
        threading.Thread(
            target=self._run_agent,
            args=(session, self._row(sample)),
            daemon=True,
            name=f"openai-agent-{session.id}",
        ).start()
        return AgentEpisode(self, session, sample)

    def session_of(self, sample: Any) -> Session:
        with self._lock:
            return next(s for s in self.sessions.values() if s.sample is sample)

    def close(self) -> None:
        """Stop the server (every live session's waiting call gets HTTP 410)."""
        self._finalizer()

    def _row(self, sample: Any) -> dict[str, Any]:
        metadata = sample.metadata
        prompt = metadata.get(self.params.prompt_key, sample.prompt_text)
        row = {
            "prompt": prompt,
            "prompt_text": sample.prompt_text,
            "label": sample.label,
            "metadata": metadata,
        }
        return copy.deepcopy(row)  # the agent may edit what it gets; the sample stays as it was

    def _run_agent(self, session: Session, row: dict[str, Any]) -> None:
        import openai

        timeout = self.params.call_timeout_s + 5.0
        try:
            if inspect.iscoroutinefunction(self.agent):

                async def run() -> Any:
                    async with openai.AsyncOpenAI(
                        base_url=session.base_url, api_key="relax", max_retries=0, timeout=timeout
                    ) as client:
                        return await self.agent(client, row, **self.params.agent_kwargs)

                value = asyncio.run(run())
            else:
                with openai.OpenAI(
                    base_url=session.base_url, api_key="relax", max_retries=0, timeout=timeout
                ) as client:
                    value = self.agent(client, row, **self.params.agent_kwargs)
        except BaseException as exc:  # noqa: BLE001 - the episode reports it, naming the session
            session.events.put(("raise", exc))
        else:
            session.events.put(("return", value))


class AgentEpisode:
    """``Episode`` over one session: ``step`` answers the pending call and waits for the agent's next move."""

    def __init__(self, env: OpenAIAgentEnvironment, session: Session, sample: Any) -> None:
        self.env, self.session, self.sample = env, session, sample

    def step(self, turn: Turn) -> StepResult:
        session = self.session
        if session.pending is None:  # the first turn: the agent's first call must be this prompt
            session.hold(self._first_call())
            self._check_first_call(session.pending)
        record = self._record(turn)
        call, session.pending = session.pending, None
        texts = (
            [self.env.tokenizer.decode([t]) for t in record.token_ids] if call.body.get("logprobs") else []
        )
        call.answer(200, completion_body(session, len(session.records), call.body, record, texts))
        session.records.append(record)
        session.messages.append(_assistant_message(record))
        kind, value = self._next()
        if kind == "return":
            return _result(session, value)
        new = self._continuation(value)
        session.hold(value)
        record.observations = [_observation(m) for m in new]
        return StepResult(observations=record.observations, info={"agent_calls": 1.0})

    def close(self) -> None:
        self.session.close("the episode ended (relax turn/token limit, timeout or error)")

    # ------------------------------------------------------------------ the agent's moves
    def _next(self) -> tuple[str, Any]:
        kind, value = self.session.next_event(self.env.params.call_timeout_s)
        if kind == "raise":
            raise RuntimeError(
                f"openai_agent session {self.session.id}: the agent raised {type(value).__name__}: {value}"
            ) from value
        if kind == "closed":
            raise RuntimeError(f"openai_agent session {self.session.id} is closed: {value}")
        return kind, value

    def _first_call(self) -> Call:
        kind, value = self._next()
        if kind == "return":
            raise RuntimeError(
                f"openai_agent session {self.session.id}: the agent returned {value!r} before its first call"
            )
        return value

    def _fail(self, call: Call, message: str) -> NoReturn:
        call.fail(400, message)
        raise ValueError(message)

    def _check_first_call(self, call: Call) -> None:
        messages = call.body["messages"]
        self.session.messages = [dict(m) for m in messages]
        if not self.env.params.check_prompt:
            return
        tok = self.env.tokenizer
        kwargs = {"tools": call.body["tools"]} if call.body.get("tools") else {}
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, named for the agent and the run
            self._fail(
                call,
                f"openai_agent session {self.session.id}: the chat template cannot render the agent's "
                f"first request ({type(exc).__name__}: {exc})",
            )
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        expected = list(self.sample.prompt_ids)
        if ids != expected:
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
                min(len(ids), len(expected)),
            )
            self._fail(
                call,
                (
                    f"openai_agent session {self.session.id}: the agent's first request renders to a different prompt than "
                    f"the sample's ({len(ids)} vs {len(expected)} tokens, first difference at token {at}: agent "
                    f"{tok.decode(ids[at : at + 12])!r} vs dataset {tok.decode(expected[at : at + 12])!r}); the agent must send "
                    "exactly the dataset prompt (same messages, system prompt and tools) for token-in/token-out"
                ),
            )

    def _continuation(self, call: Call) -> list[dict[str, Any]]:
        """The messages of ``call`` beyond the conversation so far; an error if it rewrote any of it."""
        messages, known = call.body["messages"], self.session.messages
        for i, old in enumerate(known):
            if i >= len(messages) or _normal(messages[i]) != _normal(old):
                got = (
                    json.dumps(messages[i])[:200] if i < len(messages) else "nothing (the request is shorter)"
                )
                self._fail(
                    call,
                    (
                        f"openai_agent session {self.session.id}: request {len(self.session.records) + 1} rewrites message {i} "
                        f"of the conversation (expected {json.dumps(old)[:200]}, got {got}); a session's requests must extend "
                        "the previous request plus the assistant reply (token-in/token-out)"
                    ),
                )
        new = [dict(m) for m in messages[len(known) :]]
        if any(m.get("role") == "assistant" for m in new):
            self._fail(
                call,
                f"openai_agent session {self.session.id}: the agent added an assistant message of its own; "
                "only the policy's sampled turns may be assistant messages",
            )
        self.session.messages = [*known, *new]
        return new

    def _record(self, turn: Turn) -> CallRecord:
        """The turn as sampled: its tokens and logprobs are the last ones core appended to the sample."""
        n, sample = len(turn.token_ids), self.sample
        ours = (
            n
            and sample.response_ids[-n:] == list(turn.token_ids)
            and len(sample.rollout_logprobs) == len(sample.response_ids)
        )
        prompt = list(sample.prompt_ids) + list(sample.response_ids[: len(sample.response_ids) - n])
        calls = [
            {
                "id": c.id or f"call_{self.session.id}_{turn.index}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(c for c in turn.tool_calls if not c.error)
        ]
        return CallRecord(
            prompt,
            list(turn.token_ids),
            list(sample.rollout_logprobs[-n:]) if ours else None,
            turn.finish_reason,
            turn.content,
            calls,
        )


def _assistant_message(record: CallRecord) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": record.content}
    if record.tool_calls:
        message["tool_calls"] = record.tool_calls
    return message


def _result(session: Session, value: Any) -> StepResult:
    if value is None:
        return StepResult(done=True)
    if isinstance(value, dict):
        info = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, int | float)}
        reward = value.get("reward")
        return StepResult(done=True, reward=None if reward is None else float(reward), info=info)
    if isinstance(value, int | float):
        return StepResult(done=True, reward=float(value))
    raise TypeError(
        f"openai_agent session {session.id}: the agent returned {type(value).__name__}; "
        "expected a number, {'reward': number, ...} or None"
    )


def _text(content: Any) -> Any:
    """Message content as text when it is all text (``None`` and ``""`` alike); media parts kept."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else p for p in content]
        return "".join(parts) if all(isinstance(p, str) for p in parts) else parts
    return content


def _normal(message: dict[str, Any]) -> tuple:
    """What a message means to the chat template: role, text, tool calls (arguments parsed)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return message.get("role"), json.dumps(_text(message.get("content")), sort_keys=True), tuple(calls)


def _observation(message: dict[str, Any]) -> dict[str, Any]:
    """An agent message as core renders observations: text content, or parts with ``{"type": "image"}``."""
    content = _text(message.get("content"))
    if isinstance(content, list):
        content = [
            {"type": "image", "image": p["image_url"]["url"]}
            if isinstance(p, dict) and p.get("type") == "image_url"
            else p
            for p in content
        ]
    out = {"role": message.get("role", "user"), "content": content}
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


def openai_agent_environment(params: OpenAIAgentParams, ctx: Any) -> OpenAIAgentEnvironment:
    """The registered factory: the tokenizer comes from the run's model."""
    from transformers import AutoTokenizer

    if not params.agent:
        raise ValueError("environment.params.agent: set it to the agent function, 'module:function'")
    return OpenAIAgentEnvironment(params, AutoTokenizer.from_pretrained(ctx.tokenizer_path or ctx.model_path))
