"""``RewardConformance``: a reward returns a finite float or a dict with ``"score"``, deterministically,
and core's runner (``relax.core.rewards.runner.score_samples``) bounds it with a timeout."""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import time
from typing import Any

import pytest

from relax.core.data import Sample
from relax.core.protocols import Reward
from relax.core.rewards.runner import RewardError, score_samples

#: (response, label) pairs of the default samples: right, wrong, prose around a number, empty
DEFAULT_CASES = (("7", "7"), ("8", "7"), ("The answer is 12", "12"), ("", "5"))


def default_samples() -> list[Sample]:
    return [
        Sample(
            prompt_ids=[1, 2, 3],
            group_id=i // 2,
            index_in_group=i % 2,
            prompt_text=f"question {i}",
            response_text=response,
            label=label,
        )
        for i, (response, label) in enumerate(DEFAULT_CASES)
    ]


async def score_once(reward: Any, sample: Any) -> Any:
    """``reward.score(sample)``, whether it is a coroutine function or a plain one."""
    if inspect.iscoroutinefunction(reward.score):
        return await reward.score(sample)
    return await asyncio.to_thread(reward.score, sample)


def check_value(value: Any) -> float:
    """The score of a reward's return value; fails unless it is a finite float or such a dict."""
    if isinstance(value, dict):
        assert "score" in value, f"a dict reward must contain 'score', got keys {sorted(value)}"
        bad = {
            k: v for k, v in value.items() if not (isinstance(v, numbers.Real) and math.isfinite(float(v)))
        }
        assert not bad, f"reward info values must be finite numbers: {bad}"
        return float(value["score"])
    assert isinstance(value, numbers.Real) and not isinstance(value, bool), (
        f"a reward returns a float or a dict with 'score', got {type(value).__name__}"
    )
    assert math.isfinite(float(value)), f"non-finite score {value}"
    return float(value)


class RewardConformance:
    """Subclass as ``class TestMyReward(RewardConformance)`` and implement ``make_reward``.

    Override ``samples`` for inputs your reward understands (default: numeric answers with string
    labels), ``expected_scores`` to pin their scores, and ``slow_sample`` to a sample your reward
    takes longer than ``timeout_s`` on, to check that the runner times it out.
    """

    #: runner timeout used with ``slow_sample``
    timeout_s: float = 1.0
    #: a normal score must finish within this many seconds
    score_budget_s: float = 60.0

    def make_reward(self) -> Reward:
        raise NotImplementedError(f"{type(self).__name__} must implement make_reward(self)")

    def samples(self) -> list[Sample]:
        return default_samples()

    def expected_scores(self) -> list[float] | None:
        """The ``"score"`` of each of ``samples()``; None skips the check."""
        return None

    def slow_sample(self) -> Sample | None:
        """A sample that takes the reward longer than ``timeout_s``; None skips the timeout check."""
        return None

    @pytest.fixture
    def reward(self) -> Any:
        return self.make_reward()

    def _score_all(self, reward: Any, samples: list[Sample]) -> list[Any]:
        async def all_of():
            return await asyncio.wait_for(
                asyncio.gather(*(score_once(reward, s) for s in samples)), self.score_budget_s
            )

        return asyncio.run(all_of())

    def test_is_a_reward(self, reward):
        assert isinstance(reward, Reward), f"{type(reward).__name__} has no score(sample)"

    def test_returns_a_finite_float_or_a_dict_with_score(self, reward):
        for sample, value in zip(self.samples(), self._score_all(reward, self.samples()), strict=True):
            try:
                check_value(value)
            except AssertionError as e:
                raise AssertionError(f"sample {sample.response_text!r}: {e}") from None

    def test_scores_are_deterministic_and_leave_the_sample_alone(self, reward):
        samples = self.samples()
        pristine = copy.deepcopy(samples)
        first = [check_value(v) for v in self._score_all(reward, samples)]
        second = [check_value(v) for v in self._score_all(reward, samples)]
        assert first == second, f"the same samples scored {first}, then {second}"
        assert samples == pristine, "score() must not modify the sample"

    def test_expected_scores(self, reward):
        expected = self.expected_scores()
        if expected is None:
            pytest.skip("expected_scores() not given")
        got = [check_value(v) for v in self._score_all(reward, self.samples())]
        assert got == pytest.approx(expected), f"scores {got} != expected {expected}"

    def test_runner_scores_every_sample(self, reward):
        samples = self.samples()
        direct = [check_value(v) for v in self._score_all(reward, copy.deepcopy(samples))]
        stats = asyncio.run(score_samples(reward, samples, timeout_s=self.score_budget_s, on_error="raise"))
        assert (stats.scored, stats.failures) == (len(samples), 0), stats
        assert [s.reward for s in samples] == direct
        assert all(s.reward_info.get("score") == s.reward for s in samples)

    def test_runner_times_out_a_slow_sample(self, reward):
        slow = self.slow_sample()
        if slow is None:
            pytest.skip("slow_sample() not given: no input makes this reward slower than timeout_s")
        start = time.monotonic()
        with pytest.raises(RewardError, match="timed out"):
            asyncio.run(score_samples(reward, [copy.deepcopy(slow)], timeout_s=self.timeout_s))
        assert time.monotonic() - start < self.timeout_s + 10, "the runner waited far past timeout_s"
        batch = [copy.deepcopy(slow), *self.samples()]
        stats = asyncio.run(score_samples(reward, batch, timeout_s=self.timeout_s, on_error="zero"))
        assert stats.timeouts == 1 and stats.scored == len(batch) - 1, stats
        assert batch[0].reward == 0.0 and batch[0].reward_info.get("reward_failed") == 1.0
