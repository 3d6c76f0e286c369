"""Algorithm math for Relax: pure functions on tensors (no Ray, no logging, inputs never mutated).

- advantage estimators ``fn(AdvantageInputs, **params) -> (advantages, returns)``
- policy losses ``fn(PolicyLossInputs, **params) -> (loss, metrics)``
- KL estimators ``fn(logprobs, ref_logprobs) -> per-token KL``
- masked reductions, ``aggregate_loss``, ``logprobs_from_logits`` / ``entropy_from_logits`` /
  ``logprobs_and_sum_pi_squared``,
  mismatch corrections, DAPO helpers, KL controllers, value loss
- ``compute_advantages(cfg, inputs)`` and ``build_policy_objective(cfg)``: what the trainer calls

Names resolve through the plugin registry (``get_*``), so plugins can add their own; what each
consumes is declared at registration (``needs``, ``modes``: ``algorithm_spec``, ``config_needs``).
"""

from relax.core.algorithm_needs import MODES, NEEDS, TRAINER_CAPABILITIES, AlgorithmSpec
from relax.core.algorithms.advantages import AdvantageInputs, last_token_rewards
from relax.core.algorithms.aggregation import (
    AGG_MODES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    safe_div,
)
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
    KL_ESTIMATORS,
    KLController,
    apply_kl_penalty,
    entropy_from_logits,
    logprobs_and_sum_pi_squared,
    logprobs_from_logits,
    update_kl_controller,
)
from relax.core.algorithms.objective import build_policy_objective, compute_advantages
from relax.core.algorithms.policy_losses import PolicyLossInputs
from relax.core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    algorithm_spec,
    algorithm_specs,
    config_needs,
    declared_by,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
    list_advantage_estimators,
    list_kl_estimators,
    list_policy_losses,
    register_builtin_algorithms,
)
from relax.core.algorithms.validate import algorithm_config_errors
from relax.core.algorithms.value import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "MODES",
    "NEEDS",
    "POLICY_LOSSES",
    "TRAINER_CAPABILITIES",
    "AdvantageInputs",
    "AlgorithmConfig",
    "AlgorithmSpec",
    "CorrectionConfig",
    "CriticConfig",
    "DynamicSamplingConfig",
    "KLConfig",
    "KLController",
    "OverlongConfig",
    "PolicyLossInputs",
    "add_opd_to_advantages",
    "aggregate_loss",
    "algorithm_config_errors",
    "algorithm_spec",
    "algorithm_specs",
    "apply_kl_penalty",
    "build_policy_objective",
    "clipped_value_loss",
    "compute_advantages",
    "config_needs",
    "declared_by",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "last_token_rewards",
    "list_advantage_estimators",
    "list_kl_estimators",
    "list_policy_losses",
    "logprobs_and_sum_pi_squared",
    "logprobs_from_logits",
    "masked_is",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "opsm_mask",
    "overlong_penalty",
    "register_builtin_algorithms",
    "safe_div",
    "truncated_is",
    "update_kl_controller",
]
