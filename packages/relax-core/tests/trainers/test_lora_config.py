"""``trainer.lora`` validation: its own fields, and the backends / engines that refuse it by name."""

from __future__ import annotations

import pytest

from relax.core.config import ConfigError, LoraConfig, load_config
from relax.core.plugins import get_plugin_manager


def test_lora_section_is_typed_and_off_by_default():
    assert load_config(None).trainer.lora is None
    cfg = load_config(None, ["trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.trainer.lora == LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("trainer.lora.rank=0", "trainer.lora.rank"),
        ("trainer.lora.dropout=1.0", "trainer.lora.dropout"),
        ("trainer.lora.target_modules=[]", "trainer.lora.target_modules"),
        ("trainer.lora.ranks=4", "trainer.lora.ranks: unknown key"),
    ],
)
def test_bad_lora_fields_are_named(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("plugin", "overrides", "names"),
    [
        ("megatron", ["trainer.backend=megatron"], "trainer.backend megatron"),
    ],
)
def test_backends_and_engines_without_lora_refuse_it_at_validation(plugin, overrides, names):
    kinds = ("trainer", "rollout_engine")
    if not any(plugin in get_plugin_manager().names(kind) for kind in kinds):
        pytest.skip(f"the {plugin} plugin is not installed")
    load_config(None, overrides)  # fine without LoRA
    with pytest.raises(ConfigError, match=f"trainer.lora: .*{names}"):
        load_config(None, [*overrides, "trainer.lora.rank=8"])
