"""Placement by node label (``ray.nodes``), pure parts: the config checks ``relax validate`` and
``relax run`` share, the plan's pinned groups, and the shortfall message from a cluster's nodes."""

from __future__ import annotations

import pytest

from relax.core.cluster import NODE_LABEL, actor_options, driver_paths, pin_errors, placement_shortfalls
from relax.core.config import load_config
from relax.core.context import Resources
from relax.core.controller.hosting import driver_problems, placement_errors
from relax.core.controller.placement import plan


def _node(label: str, cpus: float, alive: bool = True) -> dict:
    """A row as ``ray.nodes()`` returns it."""
    return {"Alive": alive, "Labels": {NODE_LABEL: label, "ray.io/node-id": "x"}, "Resources": {"CPU": cpus}}


def test_pins_are_checked_like_the_rest_of_the_config(tmp_path):
    ok = load_config(
        None, [f"run_dir={tmp_path}", "mode=async", "ray.nodes.trainer=train", "ray.nodes.rollout=gen"]
    )
    assert pin_errors(ok) == [] and placement_errors(ok) == []
    assert (
        actor_options(ok, "rollout") == {"label_selector": {NODE_LABEL: "gen"}}
        and actor_options(ok, "reward") == {}
    )
    assert any("ray.nodes pins roles" in p for p in driver_problems(ok))  # a pinned run needs Ray
    bad = load_config(None, [f"run_dir={tmp_path}", "mode=async", "ray.nodes.critic=x"])
    assert placement_errors(bad) == [
        "ray.nodes.critic: unknown role; pinnable roles: trainer, rollout, reward, reference, teacher"
    ]
    colocate = load_config(None, [f"run_dir={tmp_path}", "ray.nodes.trainer=train", "ray.nodes.rollout=gen"])
    (error,) = placement_errors(colocate)
    assert "mode 'colocate' shares one placement group" in error and "trainer='train', rollout='gen'" in error


def test_the_plan_pins_each_group_to_its_label():
    one, two = Resources(num_cpus=1), Resources(num_cpus=2, num_workers=2)
    p = plan("async", two, one, 2, nodes={"trainer": "train", "rollout": "gen"})
    assert [(g.role, g.node) for g in p.groups] == [
        ("trainer", "train"),
        ("rollout[0]", "gen"),
        ("rollout[1]", "gen"),
    ]
    assert plan("async", two, one, 2).groups[0].node is None
    (shared,) = plan("colocate", one, one, 1, nodes={"rollout": "gpu"}).groups
    assert shared.node == "gpu"


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([_node("train", 4), _node("gen", 2)], []),
        (
            [_node("train", 4), _node("gen", 2, alive=False)],
            [
                "rollout engines: pinned to nodes labelled relax-node=gen, but no alive node has that label (labels present: "
                "train); start one with `ray start --labels relax-node=gen`"
            ],
        ),
        (
            [_node("train", 4), _node("gen", 1)],
            [
                "rollout engines: needs CPU=2 in all (those nodes have 1) on nodes labelled relax-node=gen (1 alive)"
            ],
        ),
    ],
)
def test_shortfalls_name_the_role_the_label_and_what_is_missing(nodes, expected):
    groups = [
        ("trainer", "train", [{"CPU": 2.0}]),
        ("rollout engines", "gen", [{"CPU": 1.0}, {"CPU": 1.0}]),
        ("reward", None, [{"CPU": 99.0}]),
    ]  # unpinned: not checked here (Ray places it anywhere)
    assert placement_shortfalls(groups, nodes) == expected


def test_a_bundle_larger_than_any_one_node_is_named():
    nodes = [_node("gen", 2), _node("gen", 2)]
    (problem,) = placement_shortfalls([("rollout engines", "gen", [{"CPU": 3.0}])], nodes)
    assert problem == (
        "rollout engines: needs a bundle of CPU=3 (the largest such node has 2) on nodes labelled "
        "relax-node=gen (2 alive)"
    )


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.2:6379", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("10.0.0.1:6379", False),
        ("auto", False),
    ],
)
def test_joining_a_cluster_on_loopback_keeps_ray_on_loopback(address, loopback):
    """``relax run --address 127.0.0.x:port`` (``ray start`` nodes on one machine): Ray must not swap the
    loopback address for the machine's network address while joining (``ray_start._single_machine``)."""
    from relax.core.controller.ray_start import _is_loopback

    assert _is_loopback(address) is loopback


def test_relative_paths_are_made_absolute_against_the_drivers_directory(tmp_path, monkeypatch):
    """Roles on other nodes run in their node's directory: what they read or write must not be relative."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "m"
    (tmp_path / "runs" / "old").mkdir(parents=True)
    cfg = load_config(
        None, ["run_dir=runs/x", "model.path=m", "data.path=d.jsonl", "checkpoint.resume=runs/old"]
    )
    fixed = driver_paths(cfg)
    assert (fixed.run_dir, fixed.model.path, fixed.data.path, fixed.checkpoint.resume) == (
        str(tmp_path / "runs" / "x"),
        str(model),
        str(tmp_path / "d.jsonl"),
        str(tmp_path / "runs" / "old"),
    )
    for resume in ("auto", "never"):
        assert driver_paths(load_config(None, [f"checkpoint.resume={resume}"])).checkpoint.resume == resume
    assert driver_paths(fixed) == fixed and driver_paths(load_config(None, [])).model.path is None
