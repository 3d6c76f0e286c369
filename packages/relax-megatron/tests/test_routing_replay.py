"""MoE routing replay (algorithm.routing_replay) on the megatron trainer: refused at validation, naming what is missing."""

from __future__ import annotations

import pytest

from relax.core.config import ConfigError, config_from_dict


def test_routing_replay_is_refused_at_validation_naming_what_is_missing():
    assert config_from_dict({"trainer": {"backend": "megatron"}}).trainer.backend == "megatron"
    with pytest.raises(ConfigError) as err:
        config_from_dict({"trainer": {"backend": "megatron"}, "algorithm": {"routing_replay": "rollout"}})
    message = str(err.value)
    assert "algorithm.routing_replay: 'rollout' is not supported by trainer.backend megatron" in message
    assert "moe_enable_routing_replay" in message and "RouterReplay" in message
