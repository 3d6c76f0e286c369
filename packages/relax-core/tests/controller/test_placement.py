"""Placement groups: the plan from declared resources, real reservation and release on the session's
Ray, a clear error for what cannot be granted, and no group left behind by a run's start-up and shutdown."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util import placement_group_table

from relax.core.config import load_config
from relax.core.context import Resources
from relax.core.controller import runtime
from relax.core.controller.placement import MIN_CPU, PlacementError, plan, plan_for, required_cpus, reserve


def _states(names: list[str]) -> dict[str, str]:
    """State of each named group (the newest entry per name)."""
    out = {}
    for entry in placement_group_table().values():
        if entry["name"] in names:
            out[entry["name"]] = entry["state"]
    return out


def test_colocate_shares_bundles_between_trainer_ranks_and_engines():
    p = plan(
        "colocate", Resources(num_cpus=1, num_gpus=1, num_workers=2), Resources(num_cpus=2), num_engines=3
    )
    (group,) = p.groups
    assert group.bundles == ({"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2})
    assert [(s.bundle, s.num_gpus) for s in p.trainer] == [(0, 1), (1, 1)]
    assert [s.bundle for s in p.engines] == [0, 1, 2]
    for b, bundle in enumerate(group.bundles):  # every actor fits beside the others on its bundle
        on_b = [s for s in (*p.trainer, *p.engines) if s.bundle == b]
        assert sum(s.num_cpus for s in on_b) <= bundle["CPU"] + 1e-9
        assert sum(s.num_gpus for s in on_b) <= bundle.get("GPU", 0) + 1e-9
    assert p.engines[2].num_cpus == 2  # alone on its bundle: the whole declaration


def test_async_gives_the_trainer_and_each_engine_their_own_groups():
    p = plan(
        "async", Resources(num_cpus=1, num_workers=2), Resources(num_cpus=1, num_gpus=1, num_workers=2), 2
    )
    assert [g.role for g in p.groups] == ["trainer", "rollout[0]", "rollout[1]"]
    assert p.groups[0].bundles == ({"CPU": 1}, {"CPU": 1})
    assert p.groups[1].bundles == ({"CPU": 2, "GPU": 2},)  # one engine's workers share a bundle
    assert [(s.group, s.bundle, s.num_cpus) for s in p.trainer] == [(0, 0, 1), (0, 1, 1)]
    assert [(s.group, s.num_gpus) for s in p.engines] == [(1, 2), (2, 2)]
    assert p.total() == {"CPU": 6, "GPU": 4}


def test_zero_declarations_reserve_a_sliver_and_request_nothing():
    p = plan("hybrid", Resources(num_cpus=0), Resources(num_cpus=0), 1)
    assert all(g.bundles == ({"CPU": MIN_CPU},) for g in p.groups)
    assert all(s.num_cpus == 0 and s.num_gpus == 0 for s in (*p.trainer, *p.engines))


def test_embedded_ray_is_sized_to_the_reservation():
    cfg = load_config(None, ["mode=async", "rollout.num_engines=2", "trainer.backend_params={world_size: 2}"])
    assert required_cpus(cfg) == 4
    assert runtime.embedded_num_cpus(cfg) >= 4
    assert required_cpus(load_config(None, [])) == 1  # colocate: trainer and engine share one CPU
    with pytest.raises(ValueError, match=r"ray.num_cpus: 2 is less than the 4 CPUs"):
        runtime.embedded_num_cpus(
            load_config(
                None,
                [
                    "mode=async",
                    "rollout.num_engines=2",
                    "ray.num_cpus=2",
                    "trainer.backend_params={world_size: 2}",
                ],
            )
        )


def test_reserve_creates_the_declared_bundles_and_remove_releases_them(ray_local):
    cfg = load_config(
        None,
        [
            "mode=async",
            "trainer.backend_params={world_size: 2, num_cpus: 0.5}",
            "rollout.engine_params={num_cpus: 0.25}",
        ],
    )
    reserved = reserve(plan_for(cfg), timeout_s=60, fixed_cluster=True)
    try:
        assert len(reserved.names) == 2 and _states(reserved.names) == dict.fromkeys(
            reserved.names, "CREATED"
        )
        tables = [placement_group_table(pg) for pg in reserved.groups]
        assert [list(t["bundles"].values()) for t in tables] == [
            [{"CPU": 0.5}, {"CPU": 0.5}],
            [{"CPU": 0.25}],
        ]

        @ray.remote
        class Where:
            def resources(self):
                return ray.get_runtime_context().get_assigned_resources()

        actor = Where.options(**reserved.trainer_options()[1]).remote()
        assert ray.get(actor.resources.remote(), timeout=60) == {"CPU": 0.5}
        ray.kill(actor)
    finally:
        reserved.remove()
    assert _states(reserved.names) == dict.fromkeys(reserved.names, "REMOVED")


def test_a_request_the_cluster_cannot_grant_fails_naming_the_role(ray_local):
    huge = plan("async", Resources(num_cpus=512), Resources(num_cpus=1), 1)
    with pytest.raises(
        PlacementError, match=r"reserves \{CPU=513, GPU=0\}.*trainer: 1 bundle\(s\) of \{CPU=512\}"
    ):
        reserve(huge, timeout_s=60, fixed_cluster=True)
    # on a cluster that might grow, wait, then say what was asked and drop what was granted
    before = set(placement_group_table())
    started = time.monotonic()
    with pytest.raises(
        PlacementError, match=r"did not grant trainer: 1 bundle\(s\) of \{CPU=512\} within 2s"
    ):
        reserve(huge, timeout_s=2)
    assert time.monotonic() - started < 30
    new = [v for k, v in placement_group_table().items() if k not in before]
    assert len(new) == 2 and all(v["state"] == "REMOVED" for v in new)


def test_roles_start_on_their_bundles_and_release_everything(ray_local, tmp_path):
    """Start-up and shutdown of a run's roles (async, 2 trainer ranks): every group the run created is
    REMOVED afterwards, and a start-up failure releases them too."""
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            "mode=async",
            "trainer.backend_params={world_size: 2, num_cpus: 0.5}",
            "rollout.engine_params={num_cpus: 0.5}",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "trainer.num_minibatches=1",
        ],
    )
    from relax.core.quickstart_model import ensure_quickstart_model

    model = ensure_quickstart_model()
    before = set(placement_group_table())
    roles = runtime.start_roles(cfg, model)
    try:
        assert len(roles.trainer_peers) == 1
        assert ray.get(roles.trainer_peers[0].call.remote("state_dict_for_sync"))  # rank 1 holds a model
        names = roles.placement.names
        assert _states(names) == dict.fromkeys(names, "CREATED")
    finally:
        roles.release()
    assert _states(names) == dict.fromkeys(names, "REMOVED")
    with pytest.raises(Exception, match="no-such-model"):
        runtime.start_roles(cfg, str(tmp_path / "no-such-model"))
    new = [v for k, v in placement_group_table().items() if k not in before]
    assert len(new) == 4 and all(v["state"] == "REMOVED" for v in new), new
