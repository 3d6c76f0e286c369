"""Built-in rewards (``exact_match``, ``numeric``) and the concurrent, time-limited scoring runner."""

from relax.core.rewards.exact_match import ExactMatchReward
from relax.core.rewards.numeric import NumericReward
from relax.core.rewards.runner import RewardError, ScoreStats, ScoringLoop, reward_metrics, score_samples

__all__ = ["ExactMatchReward", "NumericReward", "RewardError", "ScoreStats", "ScoringLoop", "reward_metrics", "score_samples"]
