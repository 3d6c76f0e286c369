"""Built-in rewards (``exact_match``, ``numeric``), the concurrent, time-limited scoring runner, and
its bounded call of one scorer (``relax.core.rewards.bounded``, public for rewards that call rewards)."""

from relax.core.rewards.exact_match import ExactMatchReward
from relax.core.rewards.numeric import NumericReward
from relax.core.rewards.runner import RewardError, ScoreStats, ScoringLoop, reward_metrics, score_samples

__all__ = [
    "ExactMatchReward",
    "NumericReward",
    "RewardError",
    "ScoreStats",
    "ScoringLoop",
    "reward_metrics",
    "score_samples",
]
