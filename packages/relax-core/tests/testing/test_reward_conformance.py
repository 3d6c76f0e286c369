"""Built-in rewards pass the reward suite; a deliberately slow reward exercises the timeout check."""

import asyncio

from relax.core.data import Sample
from relax.core.rewards import ExactMatchReward, NumericReward
from relax.core.testing.reward import RewardConformance


class TestNumericRewardConformance(RewardConformance):
    def make_reward(self):
        return NumericReward()

    def expected_scores(self):  # ("7","7"), ("8","7"), ("The answer is 12","12"), ("","5")
        return [1.0, 0.0, 1.0, 0.0]


class TestExactMatchRewardConformance(RewardConformance):
    def make_reward(self):
        return ExactMatchReward()

    def expected_scores(self):
        return [1.0, 0.0, 0.0, 0.0]


class SleepyReward:
    """Exact match, but a response reading "slow" never finishes."""

    async def score(self, sample):
        if sample.response_text == "slow":
            await asyncio.sleep(3600)
        return {
            "score": float(sample.response_text == sample.label),
            "length": float(len(sample.response_text)),
        }


class TestSlowRewardConformance(RewardConformance):
    timeout_s = 0.3

    def make_reward(self):
        return SleepyReward()

    def slow_sample(self):
        return Sample(prompt_ids=[1], group_id=9, response_text="slow", label="7")
