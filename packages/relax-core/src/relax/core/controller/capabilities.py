"""Optional capabilities: methods a backend may implement, checked once at start-up.

A config that needs a capability the selected backend lacks is an error before the first step
(e.g. a PPO critic on a trainer without ``forward_values``), never a crash mid-run.
"""

from __future__ import annotations

import inspect
from typing import Any

#: every optional method the controller may call, and what it is for
OPTIONAL = {
    "abort": "end in-flight requests now (rollout.partial_rollout: abort)",
    "begin_weight_update": "prepare for a weight update (called before every transfer)",
    "end_weight_update": "finish a weight update (called after every transfer)",
    "forward_values": "critic values (algorithm.critic.enable)",
    "forward_logprobs_and_sum_pi_squared": "per-token sum of squared policy probabilities, with the logprobs",
    "save_hf": "export the final model in HF format (checkpoint.save_hf_final)",
    "score_group": "score a whole group of samples at once (rewards)",
    "release_memory": "free the engine's accelerator memory while the trainer runs (colocate)",
    "resume_memory": "take that memory back before the weight sync (colocate)",
    "offload": "move parameters and optimizer state to host memory between updates (trainer.offload)",
    "onload": "move them back before the next training step (trainer.offload)",
}


#: every flag a trainer backend may declare (a class attribute or a no-argument method returning a bool; absent:
#: False), and what the controller does differently when it is True
DECLARED = {
    "fuses_old_logprobs": "train_step scores a batch's missing old_logprobs itself, the first mini-batch's from its "
    "training forward: the controller skips its own old-logprob forward (core's loop: PolicyUpdate(fuse_old_logprobs))",
    "collective_export": "export_weights gathers across the trainer's ranks: every rank of the worker group "
    "iterates it in step with rank 0 (controller.collective)",
}


def declares(obj: Any, flag: str) -> bool:
    """Whether ``obj`` declares ``flag`` (one of :data:`DECLARED`)."""
    if flag not in DECLARED:
        raise KeyError(f"unknown declared flag {flag!r}; known: {', '.join(DECLARED)}")
    value = getattr(obj, flag, False)
    if isinstance(obj, type) and inspect.isfunction(
        value
    ):  # a per-instance answer (a method): asked of a class,
        return False  # only an instance can say (e.g. the torch trainer's depends on its LoRA dropout)
    return bool(value() if callable(value) else value)


def capabilities(obj: Any) -> list[str]:
    """The optional methods ``obj`` implements, and the :data:`DECLARED` flags it declares True."""
    methods = [name for name in OPTIONAL if callable(getattr(obj, name, None))]
    return sorted(methods + [flag for flag in DECLARED if declares(obj, flag)])


def required(cfg: Any) -> dict[str, dict[str, str]]:
    """role -> {capability: the config field that needs it}."""
    need: dict[str, dict[str, str]] = {"trainer": {}, "rollout": {}}
    if cfg.algorithm.critic.enable:
        need["trainer"]["forward_values"] = "algorithm.critic.enable"
    from relax.core.algorithms import TRAINER_CAPABILITIES, declared_by

    for declared_need, method in TRAINER_CAPABILITIES.items():  # from the algorithms' declarations
        if fields := declared_by(cfg.algorithm, declared_need):
            need["trainer"][method] = " and ".join(fields)
    if cfg.checkpoint.save_hf_final:
        need["trainer"]["save_hf"] = "checkpoint.save_hf_final"
    if cfg.rollout.release_memory:
        need["rollout"].update(
            release_memory="rollout.release_memory", resume_memory="rollout.release_memory"
        )
    if cfg.trainer.offload:
        need["trainer"].update(offload="trainer.offload", onload="trainer.offload")
    if cfg.mode != "colocate" and cfg.rollout.partial_rollout == "abort":
        need["rollout"]["abort"] = "rollout.partial_rollout=abort"
    return need


def check(cfg: Any, offered: dict[str, tuple[str, list[str]]]) -> None:
    """``offered``: role -> (backend name, its capabilities). Raises naming backend, capability and field."""
    problems = [
        f"{role} backend {offered[role][0]!r} does not implement {cap}() ({OPTIONAL[cap]}), needed by {field}"
        for role, caps in required(cfg).items()
        if role in offered
        for cap, field in caps.items()
        if cap not in offered[role][1]
    ]
    if problems:
        raise CapabilityError("; ".join(problems))


class CapabilityError(RuntimeError):
    """The selected backend lacks an optional method that the config needs."""
