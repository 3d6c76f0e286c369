"""Engine loss in the router and the fleet, on real Ray actor processes killed and stopped by pid.

The engines here are small stand-ins (no model): each answers a request with the engine's own tag
after a delay, so which engine served which request id -- and that each id is answered exactly
once -- is visible end to end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import ray

from relax.core.controller.faults import FaultCounters, NoEnginesLeft, RoleDied, RoleTimeout, wait
from relax.core.controller.fleet import EngineFleet
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.protocols import GenerationResult, SamplingParams

PARAMS = SamplingParams(max_new_tokens=2)


@ray.remote(num_cpus=0, max_concurrency=16)
class TagEngine:
    """Answers every request with ``[tag]`` after ``delay`` seconds; versions = its weight version."""

    def __init__(self, tag: int, delay: float = 0.3) -> None:
        self.reset(tag, delay)

    def reset(self, tag: int, delay: float = 0.3) -> None:
        self.tag, self.delay, self.version, self.served = tag, delay, 0, []

    def pid(self) -> int:
        return os.getpid()

    def generate(self, requests):
        time.sleep(self.delay)
        self.served += [r.request_id for r in requests]
        return [
            GenerationResult(r.request_id, [self.tag], [-0.5], [self.version], "stop", text=r.request_id)
            for r in requests
        ]

    def update_weights(self, named_tensors, version: int) -> int:
        self.version = version
        return version

    def weight_version(self) -> int:
        return self.version

    def pause(self) -> None: ...

    def resume(self) -> None: ...


def _groups(n: int = 8, size: int = 2) -> list[list[Sample]]:
    return [[Sample(prompt_ids=[1, 2], group_id=g, index_in_group=i) for i in range(size)] for g in range(n)]


def _consume(router, groups, timeout_s=30.0, step=1):
    finished, resubmitted = [], 0
    for done, n in stream_groups(router, groups, PARAMS, seed=0, step=step, timeout_s=timeout_s):
        finished += done
        resubmitted += n
    return finished, resubmitted


def _assert_each_answered_once(groups, finished):
    ids = [(s.group_id, s.index_in_group) for g in finished for s in g]
    assert sorted(ids) == sorted((s.group_id, s.index_in_group) for g in groups for s in g), (
        "lost or duplicated"
    )
    for g in groups:  # every sample holds the answer to its own request id
        for s in g:
            assert s.response_text == f"1/{s.group_id}/{s.index_in_group}" and len(s.response_ids) == 1


def _sigcont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _until_dead(handle, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.pid.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answers after {timeout_s:g}s")


class _Pool:
    """Engine actors started once per module (each costs a worker process); survivors are reused."""

    def __init__(self, size: int) -> None:
        self.free = [TagEngine.remote(0) for _ in range(size)]
        self.lent: list = []

    def take(self, tags: tuple[int, ...]) -> tuple[list, list[int]]:
        while len(self.free) < len(tags):
            self.free.append(TagEngine.remote(0))
        handles = [self.free.pop() for _ in tags]
        ray.get([h.reset.remote(tag) for h, tag in zip(handles, tags, strict=True)])
        self.lent += handles
        return handles, ray.get([h.pid.remote() for h in handles])

    def give_back(self) -> None:
        for h in self.lent:
            try:
                os.kill(ray.get(h.pid.remote(), timeout=5), signal.SIGCONT)
                ray.get(h.reset.remote(0), timeout=5)
                self.free.append(h)
            except Exception:  # killed or evicted by the test
                ray.kill(h)
        self.lent = []


@pytest.fixture(scope="module")
def pool(ray_session):
    p = _Pool(6)
    yield p
    for h in p.free + p.lent:
        ray.kill(h)


@pytest.fixture
def engines(pool):
    yield pool.take((100, 101, 102))
    pool.give_back()


def test_killed_engine_requests_go_to_the_other_exactly_once(engines):
    (a, b, _), (pid_a, _, _) = engines
    router = EngineRouter([a, b])
    groups = _groups()
    threading.Timer(0.1, os.kill, (pid_a, signal.SIGKILL)).start()  # engine 0 dies with chunks in flight
    finished, resubmitted = _consume(router, groups)
    _assert_each_answered_once(groups, finished)
    assert resubmitted > 0 and router.resubmitted == resubmitted
    assert set(router.live()) == {1}
    assert all(s.response_ids == [101] for g in groups for s in g)  # the survivor answered everything
    engine_failures = [f for g in groups for s in g for f in s.metadata.get("failures", [])]
    assert len(engine_failures) == resubmitted  # one per resubmitted request, for the step's failure report
    assert all(
        f["kind"] == "engine"
        and f["reason"].startswith("rollout engine[0] ")
        and f["reason"].endswith("; its request was resubmitted")
        for f in engine_failures
    )
    assert any("died during generate" in f["reason"] for f in engine_failures)


def test_stopped_engine_is_evicted_after_the_generate_timeout(engines):
    (a, b, _), (pid_a, _, _) = engines
    failures = []
    router = EngineRouter([a, b], on_failure=lambda i, why: (failures.append(why), router.remove_engine(i)))
    groups = _groups()
    os.kill(pid_a, signal.SIGSTOP)
    started = time.monotonic()
    try:
        finished, _ = _consume(router, groups, timeout_s=2.0)
    finally:
        _sigcont(pid_a)
    elapsed = time.monotonic() - started
    _assert_each_answered_once(groups, finished)
    assert failures == ["rollout engine[0] did not finish generate within 2s"]
    assert 2.0 <= elapsed < 2.0 + 15, elapsed


def test_engines_added_and_removed_mid_stream(engines):
    (a, b, c), _ = engines
    router = EngineRouter({3: a})
    groups = _groups(12)

    def reshape() -> None:
        time.sleep(0.1)
        router.add_engine(b, 7)
        router.remove_engine(3)  # its in-flight chunks are resubmitted
        router.add_engine(c, 8)

    threading.Thread(target=reshape).start()
    finished, resubmitted = _consume(router, groups)
    _assert_each_answered_once(groups, finished)
    assert resubmitted > 0
    assert set(router.live()) == {7, 8}
    assert {s.response_ids[0] for g in groups for s in g} <= {
        101,
        102,
    }  # the removed engine's answers were dropped
    with pytest.raises(ValueError, match=r"engine\[3\] already exists or existed"):
        router.add_engine(a, 3)  # indices are never reused


def test_losing_the_last_engine_names_it(engines):
    (a, _, _), (pid_a, _, _) = engines
    router = EngineRouter([a])
    threading.Timer(0.1, os.kill, (pid_a, signal.SIGKILL)).start()
    with pytest.raises(
        NoEnginesLeft,
        match=r"rollout engine\[0\] died during generate \(actor died\); no rollout engine left",
    ):
        _consume(router, _groups(2))


class VersionSync:
    """A ``WeightSync`` that moves no bytes: each engine is told the version (what the fleet's
    sequencing needs: which engines are synced, when, to which version)."""

    def __init__(self) -> None:
        self.synced: list[list] = []

    def sync(self, trainer, engines, version):
        ray.get([h.update_weights.remote([], version) for h in engines])
        self.synced.append(list(engines))
        return {"engines": float(len(engines))}

    def check_engine(self, engine):
        pass

    def close(self):
        pass


def _fleet(handles, max_restarts=1, start=None, control_timeout_s=2.0, on_change=None):
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            max_restarts=max_restarts,
            restart_backoff_s=0.05,
            timeout_s=30.0,
            control_timeout_s=control_timeout_s,
        )
    )
    transport = VersionSync()

    started = []

    def start_engine(index, slot):
        handle = TagEngine.remote(200 + index)
        started.append((index, slot, handle))
        return handle

    fleet = EngineFleet(
        cfg,
        list(handles),
        start or start_engine,
        transport,
        None,
        FaultCounters(),
        on_change=on_change,
        version=5,
    )
    return fleet, transport.synced, started


def test_fleet_replaces_a_dead_engine_synced_before_it_serves(engines):
    (a, b, _), (pid_a, _, _) = engines
    fleet, synced, started = _fleet([a, b])
    groups = _groups(16)
    threading.Timer(0.1, os.kill, (pid_a, signal.SIGKILL)).start()
    try:
        finished, _ = _consume(fleet.router, groups)
        _assert_each_answered_once(groups, finished)
        deadline = time.monotonic() + 60
        while 2 not in fleet.live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(fleet.live()) == [1, 2]  # the replacement has a new index
        ((index, slot, new),) = started
        assert (index, slot) == (2, 0)  # on the lost engine's reservation slot
        assert synced == [[new]]  # synced alone, before it joined the router
        assert ray.get(new.weight_version.remote()) == 5
        assert fleet.engines == [b, new]
        m = fleet.metrics()
        assert (
            m["fault/engine_evictions"] == 1
            and m["fault/engine_restarts"] == 1
            and m["fault/engines_live"] == 2
        )
        assert m["fault/last_recovery_s"] > 0
        later = _groups(6)
        _consume(fleet.router, later, step=1)
        assert {s.response_ids[0] for g in later for s in g} == {101, 202}  # the replacement serves
    finally:
        fleet.close()
        for *_, h in started:
            ray.kill(h)


def test_fleet_control_evicts_a_stopped_engine_and_names_it(engines):
    (a, b, _), (_, pid_b, _) = engines
    fleet, _, _ = _fleet([a, b], max_restarts=0, control_timeout_s=1.5)
    os.kill(pid_b, signal.SIGSTOP)
    try:
        started = time.monotonic()
        answers = fleet.control("weight_version")
        elapsed = time.monotonic() - started
    finally:
        _sigcont(pid_b)
    assert answers == {0: 0} and sorted(fleet.live()) == [0]
    assert 1.5 <= elapsed < 1.5 + 10
    assert fleet.metrics()["fault/engine_evictions"] == 1
    fleet.evict(0, "rollout engine[0] did not answer pause within 1.5s")
    with pytest.raises(
        NoEnginesLeft,
        match=r"engine\[0\] did not answer pause within 1.5s; no rollout engine left \(rollout.max_restarts=0",
    ):
        _consume(fleet.router, _groups(1))


def test_fleet_control_api_adds_and_removes(engines):
    (a, _, _), _ = engines
    changes = []
    fleet, synced, started = _fleet([a], on_change=changes.append)
    try:
        index = fleet.add_engine()
        assert index == 1 and sorted(fleet.live()) == [0, 1] and started[0][:2] == (1, None)
        assert ray.get(started[0][2].weight_version.remote()) == 5  # synced before serving
        fleet.remove_engine(0)
        assert sorted(fleet.live()) == [1]
        assert changes == [[a, started[0][2]], [started[0][2]]]  # e.g. the reward's judge handle follows
        assert fleet.add_engine() == 2 and started[1][:2] == (2, 0)  # reuses engine 0's freed reservation
        fleet.remove_engine(2)
        with pytest.raises(ValueError, match="last serving engine"):
            fleet.remove_engine(1)
        with pytest.raises(KeyError, match=r"engine\[0\] is not serving; serving: \[1\]"):
            fleet.remove_engine(0)
        assert fleet.metrics().get("fault/engine_evictions", 0) == 0  # removals by request are not faults
    finally:
        fleet.close()
        for *_, h in started:
            ray.kill(h)


def test_fleet_syncs_the_version_it_is_given_and_labels_new_engines_with_the_trained_one(engines):
    """One way down: ``sync(v)`` / ``publish(v)`` push ``v`` through the transport given at
    construction; an engine added after ``trained(v)`` gets ``v``, though no sync ran since."""
    (a, b, _), _ = engines
    fleet, synced, started = _fleet([a, b])
    try:
        assert fleet.sync(6) == {"weight_sync/engines": 2.0}
        assert ray.get([a.weight_version.remote(), b.weight_version.remote()]) == [6, 6]
        fleet.trained(7)  # a step committed; the next publication is later
        fleet.add_engine()
        ((_, _, new),) = started
        assert ray.get(new.weight_version.remote()) == 7 and synced[-1] == [new]
        assert ray.get(a.weight_version.remote()) == 6  # the serving engines keep theirs until published
        assert fleet.publish(8, abort=False) == {"weight_sync/engines": 3.0}
        assert ray.get([h.weight_version.remote() for h in (a, b, new)]) == [8, 8, 8]
    finally:
        fleet.close()
        for *_, h in started:
            ray.kill(h)


def test_wait_names_role_index_and_operation(engines):
    (a, _, _), (pid_a, _, _) = engines
    os.kill(pid_a, signal.SIGSTOP)
    try:
        with pytest.raises(RoleTimeout, match=r"^rollout engine\[4\] did not answer pause within 0.5s$"):
            wait(a.pause.remote(), 0.5, "rollout engine", "pause", index=4)
    finally:
        _sigcont(pid_a)
    ray.kill(a)
    _until_dead(a)  # ray.kill is asynchronous: a call sent at once may still be answered
    with pytest.raises(RoleDied, match=r"^trainer died during train_step \(actor died\)$"):
        wait(a.pause.remote(), 10, "trainer", "train_step")
