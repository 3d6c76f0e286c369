"""Which hub rewards are scored in the driver: every one that needs no engine handle and no network session
(so a run with one of them needs no reward actor); the hub, ``remote`` and ``genrm`` keep their actor. An
in-driver ``math`` still isolates its scoring in the hub's process pool, started from the driver."""

from __future__ import annotations

from dataclasses import replace

from relax.core.config import load_config
from relax.core.controller import local
from relax.core.controller.contexts import reward_context
from relax.core.controller.driver_reward import start_reward
from relax.core.controller.hosting import in_driver
from relax.core.data import Sample
from relax.core.lazy_ray import LocalHandle
from relax.core.plugins import get_plugin_manager

IN_DRIVER = {
    "dapo",
    "exact_match_squad",
    "f1",
    "gpqa",
    "ifbench",
    "ifeval",
    "math",
    "multiple_choice",
    "openr1_mm",
}
OWN_ACTOR = {"hub", "remote", "genrm"}


def test_rule_rewards_declare_the_driver_and_engine_or_network_rewards_do_not():
    manager = get_plugin_manager()
    declared = {n: manager.registration("reward", n).in_driver for n in IN_DRIVER | OWN_ACTOR}
    assert {n for n, yes in declared.items() if yes} == IN_DRIVER


def test_math_alone_runs_the_quickstart_in_the_driver_with_its_pool_isolated():
    cfg = load_config(None, ["reward.name=math"])
    assert in_driver(cfg)  # colocate, hf, torch, an in-driver reward: no Ray at all
    role = start_reward(cfg, reward_context(cfg, None))
    assert isinstance(role, LocalHandle)
    try:
        right = Sample(prompt_ids=[1], group_id=0, response_ids=[2], response_text="so\nAnswer: 7", label="7")
        wrong = replace(right, response_text="Answer: 8")
        scored, counts = local.get(role.score.remote([right, wrong]))
        assert [s.reward for s in scored] == [1.0, 0.0] and counts["failures"] == 0.0
        pool = role.local.reward.pool  # scoring went through worker processes, not the driver's interpreter
        assert pool is not None and pool._spawned >= 1
    finally:
        local.get(role.close.remote())
