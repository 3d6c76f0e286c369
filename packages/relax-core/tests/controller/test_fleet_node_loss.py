"""What the fleet does when engines are lost with their node, step by step: no replacement before Ray's
verdict on the node, none on a dead node's reservation, every lost engine replaced once a node has room,
a start that dies with its node spends no restart, a lost engine not replaced says why and leaves its
reservation to ``relax scale-out``, and what the run waits for is said while it waits.

The engines are real Ray actors (small stand-ins, no model); what Ray says about *nodes* is scripted
(``ScriptedCluster``, a stand-in for the cluster's verdicts and reservations, so every ordering is
deterministic). The same with real nodes lost and joining is ``integration_tests/test_multinode.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from relax.core.controller.faults import FaultCounters, NoEnginesLeft
from relax.core.controller.fleet import EngineFleet
from relax.core.controller.places import EnginePlaces
from relax.core.controller.ray_start import join_failure
from relax.core.controller.recovery import write_error_log
from relax.core.controller.shortfall import Lost, Shortfall

WANTS = "a node labelled relax-node=pool with CPU=1 free"


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self) -> None:
        self.version = 0

    def update_weights(self, named_tensors, version: int) -> int:
        self.version = version
        return version

    def weight_version(self) -> int:
        return self.version


class ScriptedCluster(EnginePlaces):
    """Ray's view of nodes, scripted: which node each engine ran on, which nodes Ray declared dead (the
    verdict waits until then), and where each engine slot's reservation sits (None: not placed)."""

    def __init__(self) -> None:
        super().__init__(None, "pool", 1.0, 0.0)
        self.on: dict[str, str] = {}  # actor id -> node
        self.dead: set[str] = set()
        self.slots: dict[int, str | None] = {}
        self.asked: list[str] = []  # verdicts asked for

    def node_of(self, handle):
        return self.on.get(handle._actor_id.hex(), "node-a")

    def verdict(self, node, stop):
        self.asked.append(node)
        while node not in self.dead:
            if stop.wait(0.05):
                return "stopped"
        return "dead"

    def has_reservation(self, slot):
        return slot is not None

    def slot_node(self, slot, exclude=None):
        node = self.slots.get(slot)
        return None if node is None or node == exclude or node in self.dead else node


class Transport:
    def sync(self, trainer, engines, version):
        ray.get([h.update_weights.remote([], version) for h in engines])
        return {}

    def check_engine(self, engine): ...

    def close(self): ...


def _fleet(cluster: ScriptedCluster, n: int, max_restarts: int, die_on: set[int] = frozenset()):
    """``n`` engines on ``node-a`` (slots 0..n-1); ``die_on``: starts whose actor is killed at once (its
    node dies under it: the cluster says it ran on ``node-c``)."""
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            max_restarts=max_restarts, restart_backoff_s=0.05, timeout_s=60.0, control_timeout_s=5.0
        )
    )
    engines = [Engine.remote() for _ in range(n)]
    ray.get([h.weight_version.remote() for h in engines])
    cluster.slots.update(dict.fromkeys(range(n), "node-a"))
    started: list[tuple[int, int | None, str | None]] = []

    def start_engine(index, slot):
        started.append((index, slot, cluster.slots.get(slot)))
        handle = Engine.remote()
        if len(started) in die_on:
            cluster.on[handle._actor_id.hex()] = "node-c"
            cluster.dead.add("node-c")
            ray.kill(handle)
        return handle

    fleet = EngineFleet(
        cfg, list(engines), start_engine, Transport(), None, FaultCounters(), version=3, places=cluster
    )
    return fleet, engines, started


def _until(what, check, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"not reached: {what}"
        time.sleep(0.05)
    return result


def _lose(fleet, engines):
    for handle in engines:
        ray.kill(handle)
    for handle in engines:  # the kill lands asynchronously: a call right after it may still be answered
        _until("the engine dead", lambda h=handle: _dead(h))
    fleet.control("weight_version")  # finds them dead: evicted
    assert not set(fleet.live()) & set(range(len(engines)))


def _dead(handle) -> bool:
    try:
        ray.get(handle.weight_version.remote(), timeout=10)
        return False
    except ray.exceptions.RayActorError:
        return True


def test_both_engines_of_a_lost_node_wait_for_the_verdict_and_a_node_then_both_come_back(ray_session):
    cluster = ScriptedCluster()
    fleet, engines, started = _fleet(cluster, 2, max_restarts=2)
    try:
        lost_at = time.monotonic()
        _lose(fleet, engines)
        waiting = lambda: [w["waiting_for"] for w in fleet.shortfall.status(0)["waiting"]]  # noqa: E731
        _until(
            "both waiting for the verdict",
            lambda: (
                waiting()
                == [
                    "Ray's verdict on the node engine[0] ran on",
                    "Ray's verdict on the node engine[1] ran on",
                ]
            ),
        )
        assert started == [] and cluster.asked == ["node-a", "node-a"]  # nothing placed on the suspect node
        cluster.dead.add("node-a")  # Ray's verdict; its reservations are not placed anywhere yet
        _until("both waiting for a node", lambda: waiting() == [WANTS, WANTS])
        time.sleep(0.3)
        assert started == []  # never started outside the reservation, nor on the dead node
        line = fleet.explain()
        assert line.startswith(
            f"0 of 2 rollout engines live; engine[2] (replacing engine[0]) waits for {WANTS} since "
        )
        assert "--labels relax-node=pool --num-cpus=1`" in line and "engine[3] (replacing engine[1])" in line
        with pytest.raises(
            NoEnginesLeft, match=rf"no rollout engine became available within 0.1s; 0 of 2 .*{WANTS}"
        ):
            fleet.router.submit([], wait_s=0.1)  # the stop message names what is missing and how to add it
        joined_at = time.monotonic()
        cluster.slots.update(
            {0: "node-b", 1: "node-b"}
        )  # a node with room joins: Ray places both reservations
        _until("both replacements serving", lambda: sorted(fleet.live()) == [2, 3])
        assert sorted(started) == [(2, 0, "node-b"), (3, 1, "node-b")]
        m = fleet.metrics()
        assert m["fault/engine_restarts"] == 2 and "fault/engine_start_failures" not in m
        assert m["fault/engines_live"] == 2 and m["fault/engines_wanted"] == 2 and fleet.explain() is None
        assert m["fault/last_recovery_s"] >= joined_at - lost_at  # measured from the loss
        assert ray.get([h.weight_version.remote() for h in fleet.live().values()]) == [3, 3]
    finally:
        fleet.close()


def test_a_lost_engine_not_replaced_says_why_and_scale_out_fills_its_reservation(ray_session):
    cluster = ScriptedCluster()
    cluster.dead.add("node-a")
    fleet, engines, started = _fleet(cluster, 2, max_restarts=1)
    try:
        cluster.slots.update({0: "node-b", 1: "node-b"})
        _lose(fleet, engines)
        _until("the one replacement serving", lambda: list(fleet.live()) == [2])
        status = fleet.shortfall.status(1)
        assert status["engines_wanted"] == 2 and status["not_replaced"][0]["engine_id"] == 1
        assert fleet.explain() == (
            "1 of 2 rollout engines live; engine[1] will not be replaced: "
            "rollout.max_restarts=1 spent (1 replacements)"
        )
        assert fleet.add_engines(1) == [3]  # `relax scale-out 1`
        assert started[-1] == (3, 1, "node-b")  # on the lost engine's reservation: the gap is filled
        assert fleet.shortfall.status(2)["not_replaced"] == [] and fleet.explain() is None
        assert fleet.metrics()["fault/engines_wanted"] == 2
    finally:
        fleet.close()


def test_a_replacement_that_dies_with_its_node_spends_no_restart(ray_session):
    cluster = ScriptedCluster()
    cluster.dead.add("node-a")
    fleet, engines, started = _fleet(cluster, 1, max_restarts=1, die_on={1})
    try:
        cluster.slots[0] = "node-c"  # Ray placed the reservation on node-c, which dies under the first start
        _lose(fleet, engines[:1])
        _until("the first start tried", lambda: started)
        _until(
            "waiting for a node again",
            lambda: [w["waiting_for"] for w in fleet.shortfall.status(0)["waiting"]] == [WANTS],
        )
        cluster.slots[0] = "node-d"
        _until("the second start serving", lambda: list(fleet.live()) == [2])
        assert [s[:2] for s in started] == [(1, 0), (2, 0)]
        m = fleet.metrics()
        assert (
            m["fault/engine_restarts"] == 1 and "fault/engine_start_failures" not in m
        )  # the one restart allowed
    finally:
        fleet.close()


def test_shortfall_counts_added_removed_and_filled_engines():
    s = Shortfall(2)
    s.gave_up(Lost(0, "engine[0] died", slot=0), "rollout.max_restarts=0 allows none")
    assert (
        s.line(1)
        == "1 of 2 rollout engines live; engine[0] will not be replaced: rollout.max_restarts=0 allows none"
    )
    s.added(2, filled=[s.orphan_of(0)])  # one added engine takes engine 0's reservation, one is new
    assert s.wanted == 3 and s.line(3) is None
    s.removed()
    assert s.wanted == 2 and s.orphan_of(0) is None


def test_join_failure_names_token_auth_on_one_side_and_the_fix(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_said = (
        "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or "
        "incorrect. Note: RAY_AUTH_MODE is currently 'disabled' (not 'token')."
    )
    try:
        try:
            raise RuntimeError(ray_said)
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from inner
    except ConnectionError as exc:
        message = join_failure("10.0.0.1:6379", exc)
    assert message.startswith(
        "could not join the Ray cluster at 10.0.0.1:6379: authentication: the cluster runs "
        "Ray's token authentication and this driver does not (RAY_AUTH_MODE=disabled): run "
        "`export RAY_AUTH_MODE=token`"
    )
    assert "(Ray said: ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken" in message
    other = join_failure(
        "10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    )
    assert (
        "`ray status --address 10.0.0.1:6379`" in other
        and f"Ray version as this driver ({ray.__version__})" in other
    )


def test_error_log_keeps_every_failure(tmp_path: Path):
    try:
        raise RuntimeError("trainer died (the node was lost)")
    except RuntimeError as first:
        write_error_log(tmp_path, first)
    path = write_error_log(tmp_path, ValueError("placement: no alive node has that label"))
    text = path.read_text()
    assert text.count("=== relax run failed at ") == 2
    assert text.index("RuntimeError: trainer died") < text.index("ValueError: placement: no alive node")


def test_the_verdict_of_real_ray_on_an_alive_and_an_unknown_node(ray_session):
    """The real ``EnginePlaces.verdict``: the driver's node is alive; a probe pinned to a node answers;
    a node Ray does not list alive is dead at once."""
    places, stop = EnginePlaces(None, None, 1.0, 0.0), threading.Event()
    here = ray.get_runtime_context().get_node_id()
    assert places.verdict(here, stop) == "alive" and places.probe(here, stop) == "alive"
    assert places.verdict("ab" * 28, stop) == "dead"
    assert places.slot_node(0) is None and not places.has_reservation(
        0
    )  # no reservation: nothing to wait for
