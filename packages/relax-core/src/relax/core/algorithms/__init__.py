"""Algorithm math for Relax: pure functions on tensors (no Ray, no logging, inputs never mutated).

- advantage estimators ``fn(AdvantageInputs, **params) -> (advantages, returns)``
- policy losses ``fn(PolicyLossInputs, **params) -> (loss, metrics)``
- KL estimators ``fn(logprobs, ref_logprobs) -> per-token KL``
- ``aggregate_loss``, mismatch corrections, DAPO helpers, KL controllers, value loss
- ``compute_advantages(cfg, inputs)`` and ``build_policy_objective(cfg)``: what the trainer calls

Names resolve through the plugin registry (``get_*``), so plugins can add their own.
"""

from relax.core.algorithms.advantages import AdvantageInputs, last_token_rewards
from relax.core.algorithms.aggregation import AGG_MODES, aggregate_loss, masked_mean, masked_whiten
from relax.core.algorithms.config import (
    AlgorithmConfig,
    CorrectionConfig,
    CriticConfig,
    DynamicSamplingConfig,
    KLConfig,
    OverlongConfig,
)
from relax.core.algorithms.corrections import masked_is, mismatch_metrics, opsm_mask, truncated_is
from relax.core.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from relax.core.algorithms.distillation import add_opd_to_advantages
from relax.core.algorithms.kl import (
    KLController,
    apply_kl_penalty,
    entropy_from_logits,
    update_kl_controller,
)
from relax.core.algorithms.objective import build_policy_objective, compute_advantages
from relax.core.algorithms.policy_losses import PolicyLossInputs
from relax.core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
    list_advantage_estimators,
    list_kl_estimators,
    list_policy_losses,
    register_builtin_algorithms,
)
from relax.core.algorithms.value import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AlgorithmConfig",
    "CorrectionConfig",
    "CriticConfig",
    "DynamicSamplingConfig",
    "KLConfig",
    "KLController",
    "OverlongConfig",
    "PolicyLossInputs",
    "add_opd_to_advantages",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_policy_objective",
    "clipped_value_loss",
    "compute_advantages",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "last_token_rewards",
    "list_advantage_estimators",
    "list_kl_estimators",
    "list_policy_losses",
    "masked_is",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "opsm_mask",
    "overlong_penalty",
    "register_builtin_algorithms",
    "truncated_is",
    "update_kl_controller",
]
