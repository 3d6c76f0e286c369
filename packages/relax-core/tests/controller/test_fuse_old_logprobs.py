"""When the colocate step leaves old logprobs to the trainer's first update (verl's on-policy shortcut)."""

from __future__ import annotations

import types
from dataclasses import replace
from types import SimpleNamespace

import pytest

from relax.core.config import load_config
from relax.core.controller.stages import fuse_old_logprobs

ROLES = SimpleNamespace(reference=None, teacher=None)


@pytest.mark.parametrize(
    ("overrides", "roles", "trainer_fuses", "expected"),
    [
        ([], ROLES, True, True),  # the quick-start: GRPO, no reference
        ([], ROLES, False, False),  # a trainer that needs old logprobs in the batch
        (["trainer.recompute_old_logprobs=false"], ROLES, True, False),  # the engine's logprobs: no forward anyway
        ([], SimpleNamespace(reference=object(), teacher=None), True, False),  # kl/policy_ref reads them first
        ([], SimpleNamespace(reference=None, teacher=object()), True, False),
        (["algorithm.advantage_estimator=optimal_token_baseline"], ROLES, True, False),  # reads old logprobs
        (["+spi_only"], ROLES, True, False),  # sum_pi_squared comes from the forward before the update
        (["+old_only"], ROLES, True, False),
        (["+plain"], ROLES, True, True),
    ],
)
def test_fuse_only_when_nothing_before_the_update_reads_old_logprobs(overrides, roles, trainer_fuses, expected):
    estimator = [o[1:] for o in overrides if o.startswith("+")]
    cfg = load_config(None, [o for o in overrides if not o.startswith("+")])
    if estimator:
        cfg = replace(cfg, algorithm=replace(cfg.algorithm, advantage_estimator=estimator[0]))
    assert fuse_old_logprobs(cfg, roles, trainer_fuses) is expected


@pytest.fixture(autouse=True)
def _declaring_estimators(monkeypatch):
    """Estimators that declare one need each, from a plugin in the process-wide registry."""
    from relax.core import plugins

    def relax_register_algorithms(register):
        for name, needs in [("spi_only", {"sum_pi_squared"}), ("old_only", {"old_logprobs"}), ("plain", ())]:
            register(name, lambda inputs: (inputs.response_mask, inputs.response_mask), kind="advantage",
                     needs=needs)

    module = types.ModuleType("fuse_test_algorithms")
    module.relax_register_algorithms = relax_register_algorithms
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"fuse_test": module}))
