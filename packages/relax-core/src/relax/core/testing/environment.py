"""``EnvironmentConformance``: what core's multi-turn loop (``relax.core.agentic.Turns``) needs from an
``Environment`` and its episodes.

``start`` gives an ``Episode`` and leaves the sample alone; ``step`` answers every turn -- malformed
or unknown tool calls and cut-off turns included -- with a ``StepResult`` instead of raising, within a
time bound; observations are chat messages the tokenizer's chat template renders as a continuation;
a finished episode's reward is a finite number or None; ``close`` may be called twice; and episodes
running at once, in threads or interleaved, give what each gives alone (no shared state).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from relax.core.agentic.bounded import TIMEOUT, call_all
from relax.core.data import Sample
from relax.core.protocols import Environment, Episode, StepResult, ToolCall, Turn

#: (prompt, label) of the default samples: different labels, so episodes that mixed them up would differ
DEFAULT_CASES = (
    ("What is 6 * 7?", "42"),
    ("What is 12 + 30?", "42"),
    ("What is 9 - 4?", "5"),
    ("Name a prime.", "7"),
)
ROLES = ("tool", "user")
MALFORMED = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'


def default_samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[1, 2, 3], group_id=i, prompt_text=prompt, label=label, metadata={"case": i})
        for i, (prompt, label) in enumerate(DEFAULT_CASES)
    ]


def make_turn(
    text: str,
    tool_calls: list[ToolCall] | None = None,
    finish_reason: str = "stop",
    content: str | None = None,
) -> Turn:
    """A policy turn as core builds it (``index`` is set when it is played); token ids are stand-ins."""
    calls = list(tool_calls or [])
    return Turn(
        index=0,
        text=text,
        token_ids=list(text.encode()[:64]) or [0],
        tool_calls=calls,
        finish_reason=finish_reason,
        content=text if content is None and not calls else content or "",
    )


def malformed_turn() -> Turn:
    """A turn whose only call could not be parsed (what a tool parser returns for broken JSON)."""
    return make_turn(MALFORMED, [ToolCall(name="", error="invalid JSON in <tool_call>", raw=MALFORMED)])


@dataclass
class Played:
    """One episode played to its end: each step's result and how long each call took."""

    results: list[StepResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # start, then each step, then close

    @property
    def done(self) -> bool:
        return bool(self.results) and self.results[-1].done is True  # results are checked StepResults

    def key(self) -> list[tuple[Any, ...]]:
        """What must not depend on other episodes running: observations, done and reward per step."""
        return [(r.observations, r.done, r.reward) for r in self.results]


def bounded(call: Callable[[], Any], budget_s: float, what: str) -> tuple[Any, float]:
    """``call()`` and its duration; fails (never hangs) when it overruns ``budget_s``; its exception re-raised."""
    start = time.monotonic()
    ((value, error),) = call_all([call], budget_s)
    elapsed = time.monotonic() - start
    if value is TIMEOUT:
        pytest.fail(
            f"{what} did not return within {budget_s:g}s (core ends the episode at environment.turn_timeout_s)"
        )
    if error is not None:
        raise error
    return value, elapsed


class EnvironmentConformance:
    """Subclass as ``class TestMyEnvironment(EnvironmentConformance)`` and implement ``make_environment``.

    Override ``samples`` for rows your environment understands, ``policy_turns`` for the turns played
    in each episode (default: a malformed tool call, then ``"The answer is <label>."``; script calls to
    your own tools here), ``expected_rewards`` to pin each episode's final reward, and
    ``make_tokenizer`` for your model's chat template. Set ``deterministic = False`` if episodes draw
    random numbers (the concurrency check then compares only how the episodes end).
    """

    #: every start / step / close must return within this many seconds
    step_budget_s: float = 10.0
    #: episodes run at once in the concurrency checks
    concurrent_episodes: int = 8
    #: turns played per episode at most
    max_turns: int = 8
    deterministic: bool = True

    def make_environment(self) -> Environment:
        raise NotImplementedError(f"{type(self).__name__} must implement make_environment(self)")

    def close_environment(self, environment: Any) -> None:
        """Release what ``make_environment`` started. Default: its ``close()``, if it has one."""
        close = getattr(environment, "close", None)
        if callable(close):
            close()

    def samples(self) -> list[Sample]:
        return default_samples()

    def policy_turns(self, sample: Sample) -> list[Turn]:
        """The policy's turns for ``sample``'s episode, played in order until one ends it."""
        return [malformed_turn(), make_turn(f"The answer is {sample.label}.")]

    def expected_rewards(self) -> list[float | None] | None:
        """The final reward of each of ``samples()`` played with ``policy_turns``; None skips the check."""
        return None

    def make_tokenizer(self) -> Any:
        """A tokenizer with the chat template observations are rendered with (default: the kit's tiny Qwen one)."""
        from relax.core.quickstart_model import build_tokenizer

        return build_tokenizer()

    @pytest.fixture
    def environment(self) -> Iterator[Any]:
        env = self.make_environment()
        yield env
        self.close_environment(env)

    # ------------------------------------------------------------------ playing
    def play(self, env: Any, sample: Sample) -> Played:
        """``sample``'s episode: started, stepped through ``policy_turns`` until done, closed."""
        episode, started = self._start(env, sample)
        steps = self._step_through(episode, self.policy_turns(sample))
        closed = bounded(episode.close, self.step_budget_s, "Episode.close")[1]
        return Played(steps.results, [started, *steps.seconds, closed])

    def play_all(self, env: Any) -> list[Played]:
        return [self.play(env, s) for s in self.samples()]

    # -------------------------------------------------------------------- tests
    def test_is_an_environment(self, environment):
        assert isinstance(environment, Environment), f"{type(environment).__name__} has no start(sample)"

    def test_start_returns_an_episode_and_leaves_the_sample_alone(self, environment):
        for sample in self.samples():
            pristine = copy.deepcopy(sample)
            episode, _ = self._start(environment, sample)
            bounded(episode.close, self.step_budget_s, "Episode.close")
            assert sample == pristine, "start() must not modify the sample (it is read-only)"

    def test_steps_return_step_results(self, environment):
        for sample, played in zip(self.samples(), self.play_all(environment), strict=True):
            for k, result in enumerate(played.results):  # play() checked each is a StepResult
                where = f"sample {sample.prompt_text!r}, turn {k}"
                assert isinstance(result.done, bool), f"{where}: done must be a bool, got {result.done!r}"
                assert isinstance(result.observations, list), (
                    f"{where}: observations must be a list of messages"
                )
                bad = {k: v for k, v in dict(result.info).items() if not _finite_number(v)}
                assert not bad, f"{where}: info values must be finite numbers (counted into metrics): {bad}"

    def test_observations_are_chat_messages(self, environment):
        for played in self.play_all(environment):
            for result in played.results:
                for message in result.observations:
                    check_message(message)

    def test_observations_render_as_a_chat_continuation(self, environment):
        from relax.core.agentic import ObservationRenderer

        renderer = ObservationRenderer(self.make_tokenizer())
        rendered = 0
        for played in self.play_all(environment):
            for result in played.results:
                texts = [m for m in result.observations if isinstance(m.get("content"), str)]
                if texts and not result.done:
                    ids = renderer.ids(texts, None)
                    assert ids, f"observations {texts} rendered to no tokens"
                    rendered += 1
        if not rendered:
            pytest.skip("no episode returned a text observation before it ended")

    def test_a_finished_episode_gives_a_reward_or_none(self, environment):
        played = self.play_all(environment)
        assert any(p.done for p in played), (
            "policy_turns() never finished an episode: override it with turns that do"
        )
        for sample, p in zip(self.samples(), played, strict=True):
            if p.done:
                reward = p.results[-1].reward
                assert reward is None or _finite_number(reward), (
                    f"sample {sample.prompt_text!r}: a finished episode's reward must be a finite number or None, "
                    f"got {reward!r}"
                )
        expected = self.expected_rewards()
        if expected is not None:
            got = [p.results[-1].reward if p.done else None for p in played]
            assert got == pytest.approx(expected), f"final rewards {got} != expected {expected}"

    def test_close_is_idempotent(self, environment):
        """Core closes an episode once, from a daemon thread, whatever ended it; a plugin's own cleanup
        may close it again."""
        sample = self.samples()[0]
        fresh, _ = self._start(environment, sample)
        finished, _ = self._start(environment, sample)
        self._step_through(finished, self.policy_turns(sample))
        for episode, when in ((fresh, "before any step"), (finished, "after its last step")):
            for attempt in ("first", "second"):
                try:
                    bounded(episode.close, self.step_budget_s, "Episode.close")
                except Exception as exc:  # noqa: BLE001 - the failure is the finding
                    pytest.fail(f"the {attempt} close() {when} raised {type(exc).__name__}: {exc}")

    def test_malformed_and_unknown_tool_calls_do_not_raise(self, environment):
        odd_turns = [
            malformed_turn(),
            make_turn("<tool_call>{}</tool_call>", [ToolCall(name="", error="no tool name", raw="{}")]),
            make_turn(
                "calling",
                [ToolCall(name="no_such_tool_in_this_environment", arguments={"x": [1, {"y": None}]})],
            ),
            make_turn('cut off <tool_call>{"na', finish_reason="length"),
            make_turn("", []),
        ]
        for turn in odd_turns:
            episode, _ = self._start(environment, self.samples()[0])
            try:
                self._step(episode, turn, 0)
            except AssertionError:
                raise
            except Exception as exc:  # noqa: BLE001 - the failure is the finding
                pytest.fail(
                    f"step() raised {type(exc).__name__}: {exc} on turn {turn.text!r} (calls {turn.tool_calls}); "
                    "answer with an error observation instead"
                )
            bounded(episode.close, self.step_budget_s, "Episode.close")

    def test_concurrent_episodes_do_not_share_state(self, environment):
        samples = self.samples()
        chosen = [samples[i % len(samples)] for i in range(self.concurrent_episodes)]
        alone = {id(s): self._key(self.play(environment, s)) for s in samples}

        played: list[Played | BaseException | None] = [None] * len(chosen)
        barrier = threading.Barrier(len(chosen))

        def run(i: int) -> None:
            try:
                barrier.wait(self.step_budget_s)
                played[i] = self.play(environment, chosen[i])
            except BaseException as exc:  # noqa: BLE001 - reported below
                played[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(chosen))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.step_budget_s * (self.max_turns + 3))
        for sample, p in zip(chosen, played, strict=True):
            if isinstance(p, BaseException):
                raise p
            assert p is not None, "an episode run in a thread did not finish"
            assert self._key(p) == alone[id(sample)], (
                f"sample {sample.prompt_text!r}: run alongside other episodes it gave {self._key(p)}, "
                f"alone {alone[id(sample)]}"
            )
        interleaved = self._interleaved(environment, chosen)
        for sample, key in zip(chosen, interleaved, strict=True):
            assert key == alone[id(sample)], (
                f"sample {sample.prompt_text!r}: stepped in turn with other episodes it gave {key}, alone {alone[id(sample)]}"
            )

    def test_steps_return_within_the_budget(self, environment):
        slowest = max(s for p in self.play_all(environment) for s in p.seconds)
        assert slowest < self.step_budget_s, (
            f"the slowest call took {slowest:.2f}s (budget {self.step_budget_s:g}s)"
        )

    # -------------------------------------------------------------------- helpers
    def _start(self, env: Any, sample: Sample) -> tuple[Any, float]:
        episode, seconds = bounded(lambda: env.start(sample), self.step_budget_s, "Environment.start")
        assert isinstance(episode, Episode), (
            f"start() returned {type(episode).__name__}, not an Episode (step, close)"
        )
        return episode, seconds

    def _step(self, episode: Any, turn: Turn, index: int) -> tuple[StepResult, float]:
        turn = dataclasses.replace(turn, index=index)
        result, seconds = bounded(
            lambda: episode.step(turn), self.step_budget_s, f"Episode.step (turn {index})"
        )
        assert isinstance(result, StepResult), f"step() returned {type(result).__name__}, not StepResult"
        return result, seconds

    def _step_through(self, episode: Any, turns: list[Turn]) -> Played:
        played = Played()
        for index, turn in enumerate(turns[: self.max_turns]):
            result, seconds = self._step(episode, turn, index)
            played.results.append(result)
            played.seconds.append(seconds)
            if result.done:
                break
        return played

    def _key(self, played: Played) -> Any:
        if self.deterministic:
            return played.key()
        return [(r.done, r.reward is None) for r in played.results]

    def _interleaved(self, env: Any, chosen: list[Sample]) -> list[Any]:
        """Start every episode, then step them round-robin from one thread."""
        episodes = [self._start(env, s)[0] for s in chosen]
        scripts = [self.policy_turns(s)[: self.max_turns] for s in chosen]
        runs = [Played() for _ in chosen]
        for index in range(self.max_turns):
            for episode, script, run in zip(episodes, scripts, runs, strict=True):
                if index < len(script) and not run.done:
                    run.results.append(self._step(episode, script[index], index)[0])
        for episode in episodes:
            bounded(episode.close, self.step_budget_s, "Episode.close")
        return [self._key(run) for run in runs]


def check_message(message: Any) -> None:
    """Fails unless ``message`` is an observation chat message core can render."""
    assert isinstance(message, dict), (
        f"an observation must be a dict chat message, got {type(message).__name__}"
    )
    assert message.get("role") in ROLES, (
        f"observation role must be one of {ROLES}, got {message.get('role')!r}"
    )
    content = message.get("content")
    if isinstance(content, str):
        return
    assert isinstance(content, list) and content, (
        f"observation content must be a str or a list of parts, got {content!r}"
    )
    for part in content:
        assert isinstance(part, dict) and isinstance(part.get("type"), str), (
            f"a content part must be a dict with 'type': {part!r}"
        )
        if part["type"] == "text":
            assert isinstance(part.get("text"), str), f"a text part needs a str 'text': {part!r}"
        elif part["type"] in ("image", "video", "audio"):
            assert part.get(part["type"]) is not None, (
                f"a {part['type']} part needs its {part['type']!r} entry: {part!r}"
            )


def _finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
