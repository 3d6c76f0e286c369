"""The run's multi-turn loop (``relax.core.agentic.Turns``), built from ``environment`` config."""

from __future__ import annotations

from typing import Any

from relax.core.agentic import EpisodeLimits, Turns
from relax.core.config import RelaxConfig
from relax.core.controller.contexts import base_context, build_plugin
from relax.core.multimodal_model import media_token_ids, model_config


def build_turns(
    cfg: RelaxConfig,
    tokenizer: Any,
    stop_token_ids: list[int],
    model_path: str,
    processor: Any = None,
) -> Turns | None:
    """None for single-completion rollouts (``environment.name`` unset). ``processor``: the dataset's, which
    renders observations that carry media (a VL / Omni model's)."""
    env = cfg.environment
    if env.name is None:
        return None
    ctx = base_context(cfg, "environment", model_path)
    limits = EpisodeLimits(
        env.max_turns, env.max_total_tokens, env.max_observation_tokens, env.turn_timeout_s, env.on_tool_error
    )
    return Turns(
        build_plugin(cfg, "environment", ctx),
        build_plugin(cfg, "tool_parser", ctx),
        tokenizer,
        limits,
        stop_token_ids,
        processor,
        media_token_ids(model_config(model_path)),
    )
