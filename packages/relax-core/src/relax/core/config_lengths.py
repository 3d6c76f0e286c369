"""Checks of the real-length settings (``trainer.max_tokens_per_micro_batch`` and friends) that need
the rest of the config: the longest row a run can produce must fit one micro-batch's token budget, and
activation recompute cannot hold MoE routing replay (its hooks cover the forward, not the recompute)."""

from __future__ import annotations

from typing import Any


def longest_row(cfg: Any) -> tuple[int, str]:
    """The most tokens one training row can hold, and the fields that bound it."""
    if cfg.environment.name:  # a multi-turn episode: prompt, turns and observations share one budget
        return (
            cfg.environment.max_total_tokens,
            f"environment.max_total_tokens = {cfg.environment.max_total_tokens}",
        )
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    return prompt + new, f"data.max_prompt_length {prompt} + rollout.max_new_tokens {new} = {prompt + new}"


def length_errors(cfg: Any) -> list[str]:
    errors = []
    if cfg.trainer.recompute != "off" and cfg.algorithm.routing_replay != "off":
        errors.append(
            f"trainer.recompute: {cfg.trainer.recompute!r} with algorithm.routing_replay "
            f"{cfg.algorithm.routing_replay!r}: the forward recomputed in backward would route with the "
            "model's own experts, not the rollout's; set trainer.recompute: off"
        )
    budget = cfg.trainer.max_tokens_per_micro_batch
    tokens, why = longest_row(cfg)
    if budget and tokens > budget:
        errors.append(
            f"trainer.max_tokens_per_micro_batch: {budget} is less than the longest row a step can hold "
            f"({why}); raise it to at least {tokens} or lower those limits"
        )
    return errors
