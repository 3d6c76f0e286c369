"""``EnvironmentConformance`` passes a small well-behaved environment and catches each seeded fault.

The faulty environments break one rule each; the suite's test methods are called directly with the
faulty environment in place of the fixture value, and the named test must fail.
"""

from __future__ import annotations

import inspect
import math
import time

import pytest

from relax.core.protocols import StepResult, ToolCall, Turn
from relax.core.testing import EnvironmentConformance
from relax.core.testing.environment import make_turn

FAILED = (AssertionError, pytest.fail.Exception)
TOOLS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


class ArithEpisode:
    """Arithmetic tools until the policy answers; the answer is right when it contains the label."""

    def __init__(self, label: str) -> None:
        self.label, self.calls, self.closed = label, 0, 0

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(done=True, reward=float(self.label in turn.content), info={"answered": 1.0})
        observations, errors = [], 0
        for call in turn.tool_calls:
            self.calls += 1
            try:
                if call.error:
                    raise ValueError(f"malformed call: {call.error}")
                text = str(TOOLS[call.name](**call.arguments))
            except (KeyError, TypeError, ValueError) as exc:
                text, errors = f"Error: {type(exc).__name__}: {exc}", errors + 1
            observations.append({"role": "tool", "content": text})
        return StepResult(
            observations, info={"tool_calls": float(len(turn.tool_calls)), "tool_errors": float(errors)}
        )

    def close(self) -> None:
        self.closed += 1


class ArithEnvironment:
    def start(self, sample) -> ArithEpisode:
        return ArithEpisode(str(sample.label))


def mul_call(a: int, b: int) -> Turn:
    return make_turn(
        f'<tool_call>{{"name": "mul", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>',
        [ToolCall(name="mul", arguments={"a": a, "b": b})],
    )


class TestArithEnvironment(EnvironmentConformance):
    concurrent_episodes = 4

    def make_environment(self):
        return ArithEnvironment()

    def policy_turns(self, sample):
        # a real call, a malformed one, then the answer (right for labels 42, wrong for the others)
        return [mul_call(6, 7), *super().policy_turns(sample)[:1], make_turn("It is 42.")]

    def expected_rewards(self):  # default samples' labels: 42, 42, 5, 7
        return [1.0, 1.0, 0.0, 0.0]


class TestDefaultScript(EnvironmentConformance):
    """The suite's own default turns (a malformed call, then the label) on the same environment."""

    concurrent_episodes = 2

    def make_environment(self):
        return ArithEnvironment()

    def expected_rewards(self):
        return [1.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------- seeded faults
class ReturnsADict(ArithEpisode):
    def step(self, turn):
        return vars(super().step(turn))


class AssistantObservation(ArithEpisode):
    def step(self, turn):
        result = super().step(turn)
        result.observations = [{"role": "assistant", "content": m["content"]} for m in result.observations]
        return result


class ContentNotText(ArithEpisode):
    def step(self, turn):
        result = super().step(turn)
        result.observations = [{"role": "tool", "content": 42} for _ in result.observations]
        return result


class NaNReward(ArithEpisode):
    def step(self, turn):
        result = super().step(turn)
        if result.done:
            result.reward = math.nan
        return result


class InfoNotANumber(ArithEpisode):
    def step(self, turn):
        result = super().step(turn)
        result.info["last_tool"] = "mul"
        return result


class NeverDone(ArithEpisode):
    def step(self, turn):
        result = super().step(turn)
        result.done = False
        return result


class CloseOnce(ArithEpisode):
    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        super().close()


class RaisesOnMalformedCalls(ArithEpisode):
    def step(self, turn):
        for call in turn.tool_calls:
            if call.error:
                raise ValueError(call.error)
            TOOLS[call.name]  # an unknown tool: KeyError
        return super().step(turn)


class Slow(ArithEpisode):
    def step(self, turn):
        time.sleep(0.6)
        return super().step(turn)


class SharedLabel(ArithEnvironment):
    """Keeps the current episode's label on the environment: episodes started later overwrite it."""

    def start(self, sample):
        self.label = str(sample.label)
        env = self

        class Shared(ArithEpisode):
            def step(self, turn):
                self.label = env.label
                return super().step(turn)

        return Shared(self.label)


class TouchesTheSample(ArithEnvironment):
    def start(self, sample):
        sample.metadata["seen"] = True
        return super().start(sample)


class NotAnEpisode(ArithEnvironment):
    def start(self, sample):
        return object()


def with_episode(cls):
    class Env(ArithEnvironment):
        def start(self, sample):
            return cls(str(sample.label))

    Env.__name__ = cls.__name__
    return Env()


FAULTS = [
    (with_episode(ReturnsADict), "test_steps_return_step_results"),
    (with_episode(AssistantObservation), "test_observations_are_chat_messages"),
    (with_episode(ContentNotText), "test_observations_are_chat_messages"),
    (with_episode(NaNReward), "test_a_finished_episode_gives_a_reward_or_none"),
    (with_episode(InfoNotANumber), "test_steps_return_step_results"),
    (with_episode(NeverDone), "test_a_finished_episode_gives_a_reward_or_none"),
    (with_episode(CloseOnce), "test_close_is_idempotent"),
    (with_episode(RaisesOnMalformedCalls), "test_malformed_and_unknown_tool_calls_do_not_raise"),
    (with_episode(Slow), "test_steps_return_within_the_budget"),
    (SharedLabel(), "test_concurrent_episodes_do_not_share_state"),
    (TouchesTheSample(), "test_start_returns_an_episode_and_leaves_the_sample_alone"),
    (NotAnEpisode(), "test_start_returns_an_episode_and_leaves_the_sample_alone"),
    (object(), "test_is_an_environment"),
]


class Probe(TestArithEnvironment):
    step_budget_s = 0.4  # Slow's 0.6 s steps overrun it
    __test__ = False


@pytest.mark.parametrize(("env", "test_name"), FAULTS, ids=[type(e).__name__ for e, _ in FAULTS])
def test_each_seeded_fault_fails_its_check(env, test_name):
    method = getattr(Probe(), test_name)
    assert list(inspect.signature(method).parameters) == ["environment"]
    with pytest.raises(FAILED):
        method(env)


def test_narrow_faults_fail_only_their_own_check():
    """A fault that leaves episodes playable fails its own check and no other, so each failure above is
    the named check at work, not collateral (faults that stop every episode -- a non-StepResult, a raise
    on the default turns' malformed call, a slow step, no Episode -- fail every check that plays)."""
    probe = Probe()
    names = [n for n in dir(EnvironmentConformance) if n.startswith("test_")]
    narrow = (
        AssistantObservation,
        NaNReward,
        InfoNotANumber,
        NeverDone,
        CloseOnce,
        SharedLabel,
        TouchesTheSample,
    )
    for env, broken in FAULTS:
        if type(env).__name__ not in {c.__name__ for c in narrow}:
            continue
        failing = []
        for name in names:
            try:
                getattr(probe, name)(env)
            except FAILED:
                failing.append(name)
            except pytest.skip.Exception:
                pass
        assert failing == [broken], (type(env).__name__, failing)
