"""Checks of the real-length settings (``trainer.max_tokens_per_micro_batch`` and friends) that need
the rest of the config: the longest row a run can produce must fit one micro-batch's token budget."""

from __future__ import annotations

from typing import Any


def longest_row(cfg: Any) -> tuple[int, str]:
    """The most tokens one training row can hold, and the fields that bound it."""
    if cfg.environment.name:  # a multi-turn episode: prompt, turns and observations share one budget
        return cfg.environment.max_total_tokens, f"environment.max_total_tokens = {cfg.environment.max_total_tokens}"
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    return prompt + new, f"data.max_prompt_length {prompt} + rollout.max_new_tokens {new} = {prompt + new}"


def length_errors(cfg: Any) -> list[str]:
    budget = cfg.trainer.max_tokens_per_micro_batch
    if not budget:
        return []
    tokens, why = longest_row(cfg)
    if tokens <= budget:
        return []
    return [f"trainer.max_tokens_per_micro_batch: {budget} is less than the longest row a step can hold ({why}); "
            f"raise it to at least {tokens} or lower those limits"]
