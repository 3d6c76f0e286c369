"""Runs across several Ray nodes on this one machine (``relax.core.testing.cluster.LocalCluster``: each
node on its own 127.0.0.x address with its own CPUs and ``relax-node`` label), one cluster for the
whole module: roles placed by node label, a run that cannot be placed, transports across nodes, the
loss of the node of both engines mid-run (the run waits, says for what, and both come back on a node that
joins), and the loss of the trainer's
node (``resume: auto`` continuing bit for bit on another). The ``ray start`` / ``relax run --address``
path, with nodes joining for the autoscaler and ``relax scale-out``, is ``test_multinode_cli.py``.

The tests share the cluster and run in file order; the node-loss tests come last (they change it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray

from relax.core.config import load_config
from relax.core.controller.placement import PlacementError
from relax.core.controller.run import run
from relax.core.hookspecs import hookimpl
from relax.core.plugins import get_plugin_manager
from relax.core.testing.cluster import LocalCluster, NodeSpec
from relax.core.weight_sync import WeightSyncError
from relax.core.weight_sync.nodes import actor_node, check_same_host

pytestmark = pytest.mark.slow

PROMPTS, GROUP, TOKENS = 2, 4, 8
SMALL = [
    f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.n_samples_per_prompt={GROUP}",
    f"rollout.max_new_tokens={TOKENS}",
    "rollout.ignore_eos=true",
    "trainer.micro_batch_size=8",
    "data.task_size=100",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "rollout.host=separate",
    "rollout.restart_backoff_s=0.2",
    "ray.nodes.trainer=train",
    "ray.nodes.rollout=rollout",
]


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver's node), a ``train`` node and two ``rollout`` nodes of one CPU each (one engine
    each). The suite's one-node Ray (``ray_session``), if up, is set aside and restored afterwards."""
    restore = ray.is_initialized()
    if restore:
        ray.shutdown()
    c = LocalCluster(
        [
            NodeSpec("head", 1),
            NodeSpec("train", 2),
            NodeSpec("rollout-a", 1, label="rollout"),
            NodeSpec("rollout-b", 1, label="rollout"),
        ]
    )
    try:
        c.connect()
        yield c
    finally:
        c.shutdown()
        if restore:  # as the repo-root conftest's ray_session starts it
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={
                    "env_vars": {
                        k: os.environ[k]
                        for k in (
                            "RAY_AUTH_MODE",
                            "HF_HUB_OFFLINE",
                            "OMP_NUM_THREADS",
                            "WANDB_MODE",
                            "RELAX_CACHE_DIR",
                        )
                        if k in os.environ
                    }
                },
            )


class Observer:
    """Driver-side plugin: the run handle and every trained (group, index), counted; ``at_step_end``
    runs in the driver's main thread (Ray starts a node only from there)."""

    def __init__(self, inject=None, at_step_end=None) -> None:
        self.inject, self.at_step_end, self.run, self.trained = inject, at_step_end, None, Counter()
        self.thread: threading.Thread | None = None

    @hookimpl
    def relax_on_run_start(self, run):
        self.run = run
        if self.inject is not None:
            self.thread = threading.Thread(target=self.inject, args=(run,), daemon=True)
            self.thread.start()

    @hookimpl
    def relax_on_step_end(self, step, metrics):
        if self.at_step_end is not None:
            self.at_step_end(self.run, step)

    @hookimpl
    def relax_filter_group(self, group):
        self.trained.update((s.group_id, s.index_in_group) for s in group if len(s.response_ids) == TOKENS)
        return True


@pytest.fixture
def observer():
    made = []

    def make(inject=None, at_step_end=None) -> Observer:
        obs = Observer(inject, at_step_end)
        get_plugin_manager().pm.register(obs, name=f"multinode-observer-{id(obs)}")
        made.append(obs)
        return obs

    yield make
    for obs in made:
        get_plugin_manager().pm.unregister(obs)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _where(handle) -> str:
    deadline = time.monotonic() + 60
    while (node := actor_node(handle)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return node


def test_trainer_and_engines_run_on_their_nodes_and_weights_cross_over_broadcast(cluster, tmp_path, observer):
    """Async quick-start: the trainer on the ``train`` node, two HF engines on the ``rollout`` nodes,
    weights over a gloo broadcast between the nodes' own addresses; every sample trained once."""
    seen = {}

    def record(run):
        deadline = time.monotonic() + 120
        while run.step < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        state = run._state
        seen["trainer"] = _where(state.roles.trainer)
        seen["engines"] = [_where(h) for h in state.fleet.live().values()]

    obs = observer(record)
    steps = 3
    cfg = load_config(
        None,
        [
            *SMALL,
            f"total_steps={steps}",
            f"run_dir={tmp_path}",
            "mode=async",
            "max_staleness=1",
            "rollout.num_engines=2",
            "weight_sync.transport=broadcast",
            f"ray.address={cluster.address}",
        ],
    )
    summary = run(cfg)
    obs.thread.join(timeout=60)
    assert summary["steps"] == steps
    assert seen["trainer"] == cluster.node_id("train")
    assert sorted(seen["engines"]) == sorted([cluster.node_id("rollout-a"), cluster.node_id("rollout-b")])
    assert obs.trained == Counter({(g, i): 1 for g in range(steps * PROMPTS) for i in range(GROUP)})
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy_version"] == 3
    assert rows[-1]["weight_sync/bytes"] > 0  # weights crossed from the train node to the rollout nodes


def test_a_run_that_cannot_be_placed_names_the_role_and_what_is_missing(cluster, tmp_path):
    absent = load_config(
        None,
        [
            *SMALL,
            "total_steps=1",
            f"run_dir={tmp_path}",
            "mode=async",
            "ray.nodes.rollout=gpu-pool",
            f"ray.address={cluster.address}",
        ],
    )
    started = time.monotonic()
    with pytest.raises(PlacementError) as err:
        run(absent)
    message = str(err.value)
    assert (
        "rollout engines: pinned to nodes labelled relax-node=gpu-pool, but no alive node has that label"
        in message
    )
    assert (
        "labels present: head, rollout, train" in message
        and "ray start --labels relax-node=gpu-pool" in message
    )
    too_many = load_config(
        None,
        [
            *SMALL,
            "total_steps=1",
            f"run_dir={tmp_path}",
            "mode=async",
            "rollout.num_engines=3",
            f"ray.address={cluster.address}",
        ],
    )
    with pytest.raises(
        PlacementError,
        match=r"rollout engines: needs CPU=3 in all \(those nodes have 2\) on nodes "
        r"labelled relax-node=rollout \(2 alive\)",
    ):
        run(too_many)
    assert time.monotonic() - started < 60  # at once, not after the placement timeout
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )  # nothing left reserved


@ray.remote(num_cpus=0)
class Side:
    """A bare actor standing for a trainer or an engine: only its node matters here."""

    def ready(self) -> bool:
        return True


def test_shared_memory_is_refused_across_nodes_by_name(cluster):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    on = {
        name: Side.options(label_selector={"relax-node": label}).remote()
        for name, label in [("trainer", "train"), ("engine", "rollout"), ("same", "train")]
    }
    ray.get([h.ready.remote() for h in on.values()], timeout=60)
    check_same_host("shared_memory", on["trainer"], [on["same"]])  # one node: allowed
    with pytest.raises(WeightSyncError) as err:
        check_same_host("shared_memory", on["trainer"], [on["same"], on["engine"]])
    message = str(err.value)
    assert "weight_sync.transport 'shared_memory' works on one machine only" in message
    assert "use object_store or broadcast across nodes" in message
    assert (
        "engine[1] (Side actor" in message and "engine[0]" not in message
    )  # names exactly the one elsewhere
    for handle in on.values():
        ray.kill(handle)


def _lose_the_pool_node_then_one_joins(cluster, seen: dict):
    """At step 2's end: the node of both engines is lost, with no other node of their label. The loss is
    noticed as the next weight publication would notice it (a control call on the engines); while the run
    waits, what ``relax status`` shows is recorded; then a node with the label joins (from the driver's
    main thread: Ray starts a node only from there) and the hook holds until both engines serve again."""
    from relax.core.control.agent import snapshot
    from relax.core.control.cli import format_status

    def at_step_end(run, step):
        if step != 2:
            return
        fleet = run._state.fleet
        seen["lost"] = sorted(fleet.live())
        seen["lost_at"] = time.monotonic()
        cluster.remove_node("pool-a")  # every process of the machine, at once
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            # A killed raylet's workers may still answer for a while: probe until both are found dead
            # (evicted; their replacements then wait for Ray and for a node).
            if fleet.live():
                fleet.control("weight_version")
            waiting = run.engine_shortfall()["waiting"]
            if len(waiting) == 2 and all(w["waiting_for"].startswith("a node labelled") for w in waiting):
                break
            time.sleep(0.2)
        seen["status"] = run.engine_shortfall()
        seen["console"] = format_status(snapshot(run, protect=False, attach=False))
        seen["joined_at"] = time.monotonic()
        cluster.add_node(NodeSpec("pool-b", 2, label="pool"))  # a machine of the pool joins
        while len(fleet.live()) < 2 and time.monotonic() < deadline + 120:
            time.sleep(0.1)

    return at_step_end


def test_losing_the_node_of_both_engines_waits_for_a_node_and_replaces_both_there(
    cluster, tmp_path, observer
):
    """Both engines on one ``pool`` node, lost mid-run with no other node of that label: the replacements
    wait for Ray to declare the node dead (none is placed on it, no restart is spent there) and then for a
    node with the label, and say so; when one joins, both engines come back on it (2 of 2), every sample
    is trained exactly once, and the recovery time counts from the loss."""
    cluster.add_node(NodeSpec("pool-a", 2, label="pool"))  # room for both engines, on one machine
    seen: dict = {}
    obs = observer(at_step_end=_lose_the_pool_node_then_one_joins(cluster, seen))
    steps = 4
    cfg = load_config(
        None,
        [
            *SMALL,
            f"total_steps={steps}",
            f"run_dir={tmp_path}",
            "mode=async",
            "max_staleness=1",
            "rollout.num_engines=2",
            "rollout.max_restarts=2",
            "rollout.timeout_s=120",
            "ray.nodes.rollout=pool",
            "weight_sync.transport=object_store",
            f"ray.address={cluster.address}",
        ],
    )
    summary = run(cfg)
    assert summary["steps"] == steps and seen["lost"] == [0, 1]
    assert obs.trained == Counter(
        {(g, i): 1 for g in range(steps * PROMPTS) for i in range(GROUP)}
    )  # none lost/twice
    status = seen["status"]  # while no node had the label
    assert status["engines_live"] == 0 and status["engines_wanted"] == 2 and not status["not_replaced"]
    assert {w["replaces"] for w in status["waiting"]} == {0, 1}
    assert all(
        w["waiting_for"] == "a node labelled relax-node=pool with CPU=1 free" for w in status["waiting"]
    )
    console = seen["console"]  # `relax status`
    assert (
        "engines: 0 of 2 rollout engines live" in console
        and "waits for a node labelled relax-node=pool" in console
    )
    assert f"ray start --address={cluster.address} --labels relax-node=pool --num-cpus=1" in console
    last = _metrics(tmp_path)[-1]
    assert (
        last["fault/engine_evictions"] == 2 and last["fault/engine_restarts"] == 2
    )  # 2 of 2, none spent on the dead node
    assert "fault/engine_start_failures" not in last
    assert last["fault/engines_live"] == 2 and last["fault/engines_wanted"] == 2
    assert (
        last["fault/last_recovery_s"] >= seen["joined_at"] - seen["lost_at"]
    )  # from the loss, not from a retry
    live = obs.run._state.fleet.live()
    assert sorted(live) == [2, 3]  # new indices, never reused
    assert {_where(h) for h in live.values()} == {cluster.node_id("pool-b")}  # on the node that joined


def _trainer_state(run_dir: Path, step: int) -> dict:
    import torch

    files = list((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer").glob("*.pt"))
    assert len(files) == 1, files
    return torch.load(files[0], weights_only=True)


def test_losing_the_trainers_node_stops_the_run_and_resume_auto_continues_identically_elsewhere(
    cluster, tmp_path, observer
):
    """The trainer's machine is lost mid-run: the run stops (no emergency checkpoint without a trainer),
    names the trainer, points at its last checkpoint; ``resume: auto`` re-places the trainer on the other
    ``train`` node and ends with exactly the weights, optimizer state and metrics of an uninterrupted run."""
    cluster.add_node(NodeSpec("train-b", 2, label="train"))  # a second machine of the training pool
    steps = 3
    common = [
        *SMALL,
        f"total_steps={steps}",
        "mode=async",
        "max_staleness=0",
        "rollout.num_engines=1",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=5",
        "weight_sync.transport=object_store",
        f"ray.address={cluster.address}",
    ]
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    run(load_config(None, [*common, f"run_dir={reference}"]))
    placed: dict = {}

    def lose_the_trainers_node(run, step):
        placed.setdefault("first", _where(run._state.roles.trainer))
        if (
            step == 2
        ):  # as step 2's checkpoint is due: the last one is step 1's or, if it beat the loss, step 2's
            placed["lost"] = next(n for n in ("train", "train-b") if cluster.node_id(n) == placed["first"])
            cluster.remove_node(placed["lost"])

    obs = observer(at_step_end=lose_the_trainers_node)
    with pytest.raises(Exception) as err:
        run(load_config(None, [*common, f"run_dir={interrupted}"]))
    assert getattr(err.value, "relax_trainer_lost", False), err.value
    assert "trainer" in str(err.value)
    saved = sorted(p.name for p in (interrupted / "checkpoints").glob("step_*"))
    assert saved and saved[-1] <= "step_000002"
    assert err.value.relax_checkpoint == str(interrupted / "checkpoints" / saved[-1])
    obs.at_step_end = None  # the resumed run loses nothing
    resumed = observer(
        at_step_end=lambda run, step: placed.setdefault("again", _where(run._state.roles.trainer))
    )
    summary = run(load_config(None, [*common, f"run_dir={interrupted}", "checkpoint.resume=auto"]))
    assert summary["steps"] == steps and resumed.run is not None
    (remaining,) = {"train", "train-b"} - {placed["lost"]}
    assert placed["again"] == cluster.node_id(remaining)  # the trainer re-placed on the other train node
    a, b = _metrics(reference), _metrics(interrupted)
    assert [r["step"] for r in b] == [1, 2, 3]
    keys = [
        "reward/mean",
        "response/length_mean",
        "train/loss",
        "train/pg_loss",
        "train/grad_norm",
        "train/entropy",
    ]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]  # bit for bit
    want, got = _trainer_state(reference, steps), _trainer_state(interrupted, steps)
    assert want["model"].keys() == got["model"].keys()
    assert all(torch_equal(want["model"][k], got["model"][k]) for k in want["model"])
    moments = list(want["optimizer"]["state"].items())
    assert moments and all(torch_equal(s[n], got["optimizer"]["state"][k][n]) for k, s in moments for n in s)


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
