"""``environment`` reward: the score the sample's episode gave (multi-turn rollouts)."""

from __future__ import annotations

from typing import Any


class EnvironmentReward:
    """Reads ``sample.metadata["episode_reward"]`` (set when the episode ended). An episode that
    ended without one (an error, a timeout, the turn or token limit) scores ``missing_score``."""

    def __init__(self, missing_score: float = 0.0) -> None:
        self.missing_score = missing_score

    async def score(self, sample: Any) -> float:
        if "episode" not in sample.metadata:
            raise ValueError("reward 'environment' needs multi-turn rollouts: set environment.name")
        value = sample.metadata.get("episode_reward")
        return self.missing_score if value is None else float(value)
