"""The multi-turn loop between the router and the environment's episodes (token in, token out)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relax.core.agentic.bounded import TIMEOUT, call_all
from relax.core.agentic.render import ObservationRenderer, fit_observations
from relax.core.data import Sample
from relax.core.data_multimodal import merge_media, resolve
from relax.core.failures import add_failure
from relax.core.protocols import (
    Environment,
    Episode,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StepResult,
    ToolParser,
    Turn,
)

#: per-episode counters, always present in ``sample.metadata["episode"]`` (an environment adds its own)
COUNTERS = (
    "turns",
    "tool_calls",
    "malformed_tool_calls",
    "tool_errors",
    "observation_tokens",
    "truncated",
    "observations_cut",
    "timeouts",
    "errors",
)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_total_tokens: int = 512
    max_observation_tokens: int = 256
    turn_timeout_s: float = 30.0
    on_tool_error: str = "observe"  # "observe" | "end"


@dataclass
class _Live:
    episode: Episode | None = None
    turns: int = 0
    stats: Counter = field(default_factory=Counter)
    log: list[dict[str, Any]] = field(default_factory=list)  # per turn, for ``relax inspect`` (episode_turns)


def turn_seed(seed: int, step: int, group_id: int, index: int, turn: int) -> int:
    """Per-turn seed: reproducible whichever engine serves the turn, different for every turn."""
    digest = hashlib.blake2b(f"{seed}/{step}/{group_id}/{index}/t{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class NoToolCalls:
    """The built-in ``none`` tool parser: a turn is plain text."""

    def parse(self, text: str) -> tuple[str, list]:
        return text, []


class Turns:
    """Builds each turn's request from the trajectory so far and advances episodes with results.

    Keyed by (step, group, index), so the same object serves every step in flight (async mode).
    Thread-safe: several rollout steps may advance at once."""

    def __init__(
        self,
        environment: Environment,
        parser: ToolParser,
        tokenizer: Any,
        limits: EpisodeLimits,
        stop_token_ids: list[int],
        processor: Any = None,
        media_token_ids: Sequence[int] = (),
    ) -> None:
        """``processor``: the run's multimodal processor, for observations carrying media (a tool's image);
        ``media_token_ids``: the model's media placeholder ids (a VL model's), see :meth:`request`."""
        self.environment, self.parser, self.tokenizer, self.limits = environment, parser, tokenizer, limits
        self.renderer = ObservationRenderer(tokenizer)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.processor, self.media_token_ids = processor, frozenset(media_token_ids)
        self._live: dict[tuple[int, int, int], _Live] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """The run ended: the environment releases what it holds (servers, tool processes), if it can."""
        close = getattr(self.environment, "close", None)
        if callable(close):
            close()

    def _state(self, step: int, sample: Sample) -> _Live:
        with self._lock:
            return self._live.setdefault((step, sample.group_id, sample.index_in_group), _Live())

    # ------------------------------------------------------------------ requests
    def request(self, sample: Sample, params: SamplingParams, seed: int, step: int) -> GenerationRequest:
        """The next turn: the prompt plus the trajectory so far, exactly as sampled and appended -- except
        that a media placeholder id the *policy sampled* goes to the engine as token 0, as every model
        adapter feeds a sampled one (``ModelAdapter.forward_kwargs``); the sample keeps the sampled id."""
        if not self._state(step, sample).turns:
            sample.response_ids, sample.rollout_logprobs, sample.versions, sample.loss_mask = [], [], [], []
        turn = self._state(step, sample).turns
        budget = min(params.max_new_tokens, self.limits.max_total_tokens - len(sample.response_ids))
        return GenerationRequest(
            request_id=f"{step}/{sample.group_id}/{sample.index_in_group}/t{turn}",
            prompt_ids=[*sample.prompt_ids, *self._context(sample)],
            media=sample.mm_inputs,
            continues=turn + 1 < self.limits.max_turns,
            params=replace(
                params,
                max_new_tokens=max(1, budget),
                seed=turn_seed(seed, step, sample.group_id, sample.index_in_group, turn),
            ),
        )

    def _context(self, sample: Sample) -> list[int]:
        if not self.media_token_ids:
            return sample.response_ids
        return [
            0 if t in self.media_token_ids and m else t
            for t, m in zip(sample.response_ids, sample.loss_mask, strict=True)
        ]

    # ------------------------------------------------------------------ results
    def advance(self, step: int, samples: list[Sample], results: list[GenerationResult]) -> list[Sample]:
        """Append each result as its sample's next turn, step the episodes (at once, each bounded by
        ``turn_timeout_s``) and return the samples that need another turn; the others are finished."""
        states = [self._state(step, s) for s in samples]
        turns = [self._append_turn(s, st, r) for s, st, r in zip(samples, states, results, strict=True)]
        outcomes = call_all(
            [
                lambda s=s, st=st, t=t: self._step(s, st, t)
                for s, st, t in zip(samples, states, turns, strict=True)
            ],
            self.limits.turn_timeout_s,
        )
        again = []
        for sample, state, turn, (value, error) in zip(samples, states, turns, outcomes, strict=True):
            where = f"turn {turn.index}"
            if value is TIMEOUT:
                self._end(
                    step,
                    sample,
                    state,
                    None,
                    timeouts=1,
                    error=f"{where}: episode call did not return within "
                    f"environment.turn_timeout_s={self.limits.turn_timeout_s:g}s (its thread was interrupted)",
                )
            elif error is not None:
                self._end(
                    step,
                    sample,
                    state,
                    None,
                    errors=1,
                    exc=error,
                    error=f"{where}: episode raised {type(error).__name__}: {error}",
                )
            else:
                for reason in (
                    value.failures if isinstance(value.failures, list | tuple) else [str(value.failures)]
                ):
                    add_failure(sample, "tool", f"{where}: {reason}")
                problem = "" if value.done else observation_problem(value.observations)
                if problem:
                    self._end(
                        step, sample, state, None, errors=1, error=f"{where}: Episode.step returned {problem}"
                    )
                    continue
                try:
                    goes_on = self._continue(sample, state, turn, value)
                except Exception as exc:  # noqa: BLE001 - an observation that cannot be appended (bad media)
                    self._end(
                        step,
                        sample,
                        state,
                        None,
                        errors=1,
                        exc=exc,
                        error=f"{where}: observation could not be appended: {type(exc).__name__}: {exc}",
                    )
                    continue
                if goes_on:
                    again.append(sample)
                else:
                    self._end(step, sample, state, value)
        return again

    def _append_turn(self, sample: Sample, state: _Live, result: GenerationResult) -> Turn:
        new = list(result.response_ids)
        sample.response_ids += new
        sample.rollout_logprobs += list(result.logprobs)
        sample.versions += list(result.versions)
        sample.loss_mask += [1.0] * len(new)
        sample.finish_reason = result.finish_reason
        # MoE routing replay: this turn's prompt is the whole episode so far, so its routing covers every token
        sample.routed_experts = getattr(result, "routed_experts", None)
        body = new[:-1] if new and new[-1] in self.stop_token_ids else new
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        content, calls = self.parser.parse(text)
        sample.response_text = self.tokenizer.decode(body, skip_special_tokens=True)
        state.turns += 1
        state.stats["turns"] += 1
        state.stats["tool_calls"] += len(calls)
        state.stats["malformed_tool_calls"] += sum(bool(c.error) for c in calls)
        state.log.append(
            {
                "text": text,
                "tokens": len(new),
                "finish_reason": result.finish_reason,
                "tool_calls": [
                    {"name": c.name, "arguments": c.arguments, **({"error": c.error} if c.error else {})}
                    for c in calls
                ],
            }
        )
        return Turn(state.turns - 1, text, new, calls, result.finish_reason, content, list(result.logprobs))

    def _step(self, sample: Sample, state: _Live, turn: Turn) -> StepResult:
        if state.episode is None:
            state.episode = self.environment.start(sample)
        result = state.episode.step(turn)
        if not isinstance(result, StepResult):
            raise TypeError(f"Episode.step returned {type(result).__name__}, not StepResult")
        return result

    def _continue(self, sample: Sample, state: _Live, turn: Turn, result: StepResult) -> bool:
        """Count the step's info; append its observations if the episode goes on (True)."""
        state.stats.update({k: float(v) for k, v in result.info.items()})
        limits = self.limits
        if result.done:
            return False
        # on_tool_error: end -- a malformed call, the environment's own failures, or its ``tool_errors`` count
        tool_failed = (
            result.info.get("tool_errors", 0) > 0
            or any(c.error for c in turn.tool_calls)
            or bool(result.failures)
        )
        if state.turns >= limits.max_turns or (limits.on_tool_error == "end" and tool_failed):
            state.stats["truncated"] += state.turns >= limits.max_turns
            return False
        last = turn.token_ids[-1] if turn.token_ids else None
        ended_with = self.tokenizer.decode([last]) if last in self.stop_token_ids else None
        media = None
        if any(not isinstance(m.get("content", ""), str) for m in result.observations):
            ids, media, cut = *self._media_observation(sample, result.observations, ended_with), False
            if len(ids) > limits.max_observation_tokens:  # media cannot be cut: the episode ends here
                state.stats["truncated"] += 1
                return False
        else:
            ids, cut = fit_observations(
                self.renderer, result.observations, ended_with, limits.max_observation_tokens
            )
        state.stats["observations_cut"] += cut
        if len(sample.response_ids) + len(ids) >= limits.max_total_tokens:
            state.stats["truncated"] += 1
            return False
        version = sample.versions[-1] if sample.versions else 0
        if media is not None:
            sample.mm_inputs = merge_media(resolve(sample.mm_inputs), media)
        sample.response_ids += ids
        sample.rollout_logprobs += [0.0] * len(ids)
        sample.versions += [version] * len(ids)
        sample.loss_mask += [0.0] * len(ids)
        state.stats["observation_tokens"] += len(ids)
        state.log[-1]["observations"] = [
            m.get("content") if isinstance(m.get("content", ""), str) else "<media>"
            for m in result.observations
        ]
        state.log[-1]["observation_tokens"] = len(ids)
        return True

    def _media_observation(
        self, sample: Sample, messages: list[dict[str, Any]], ended_with: str | None
    ) -> tuple[list[int], dict[str, Any]]:
        """Observation media through the run's processor: (its ids, placeholders expanded; its model inputs,
        appended to the sample's when the observation is: the model counts placeholders in order)."""
        if not callable(getattr(self.processor, "continue_with", None)):
            raise ValueError(
                "an observation carries media, but the run has no multimodal processor that can "
                "continue a conversation with it (data.processor with continue_with)"
            )
        processed = self.processor.continue_with(
            messages, ended_with, f"episode {sample.group_id}/{sample.index_in_group}"
        )
        return list(processed["prompt_ids"]), processed["inputs"]

    def _end(
        self,
        step: int,
        sample: Sample,
        state: _Live,
        result: StepResult | None,
        error: str = "",
        exc: BaseException | None = None,
        **counts: int,
    ) -> None:
        state.stats.update(counts)
        stats = {k: float(state.stats.get(k, 0)) for k in COUNTERS} | {
            k: float(v) for k, v in state.stats.items()
        }
        sample.metadata["episode"] = stats
        sample.metadata["episode_turns"] = state.log
        sample.metadata["episode_reward"] = result.reward if result is not None else None
        if error:
            sample.metadata["episode_error"] = error
            add_failure(
                sample, "episode", error, exc
            )  # on the console and in failures.jsonl (relax.core.failures)
        with self._lock:
            self._live.pop((step, sample.group_id, sample.index_in_group), None)
        if state.episode is not None:  # closing must not block the rollout either
            threading.Thread(target=_close_quietly, args=(state.episode,), daemon=True).start()


def _close_quietly(episode: Episode) -> None:
    try:
        episode.close()
    except Exception:  # noqa: BLE001 - the episode is over; a failing close loses nothing
        pass


def observation_problem(observations: Any) -> str:
    """'' when ``observations`` is a list of chat messages core can render, else what is wrong with it."""
    if not isinstance(observations, list | tuple):
        return (
            f"observations={_short(observations)} ({type(observations).__name__}); expected a list of messages "
            "like {'role': 'tool', 'content': '...'}"
        )
    for i, message in enumerate(observations):
        if not isinstance(message, dict):
            return f"observations[{i}]={_short(message)} ({type(message).__name__}); expected a message dict"
        content = message.get("content", "")
        if not isinstance(content, str) and not (
            isinstance(content, list) and all(isinstance(p, dict) for p in content)
        ):
            return (
                f"observations[{i}]['content']={_short(content)} ({type(content).__name__}); expected a string "
                "(or a list of parts such as {'type': 'image', 'image': ...} for media)"
            )
    return ""


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
