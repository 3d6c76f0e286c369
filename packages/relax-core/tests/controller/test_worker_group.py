"""Worker groups with plain rank actors: rank info, rank 0's answer, and which rank gets blamed
(and everyone stopped) when one fails, dies or hangs."""

from __future__ import annotations

import sys
import time

import pytest
import ray

from relax.core.controller.worker_group import BLAME_GRACE_S, WorkerGroup, WorkerGroupError, spawn

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Rank:
    def __init__(self, info, fail_rank: int = -1):
        if info.rank == fail_rank:
            raise ValueError(f"rank {info.rank} cannot start")
        self.info = info

    def whoami(self):
        return self.info

    def work(self, mode: str):
        if mode == f"fail{self.info.rank}":
            raise ValueError("boom")
        if mode == f"hang{self.info.rank}":
            time.sleep(600)
        return self.info.rank


def _group(ray_local, n: int = 2, fail_rank: int = -1) -> WorkerGroup:
    node = ray.get_runtime_context().get_node_id()
    actor = ray.remote(Rank)
    return spawn(
        actor, "g", [{"num_cpus": 0}] * n, lambda info: ((info, fail_rank), {}), [node] * n, timeout_s=120
    )


def _dead(handle) -> bool:
    try:
        ray.get(handle.whoami.remote(), timeout=30)
        return False
    except ray.exceptions.RayActorError:
        return True


def test_ranks_get_their_rank_and_a_loopback_rendezvous(ray_local):
    group = _group(ray_local, n=3)
    try:
        infos = ray.get([h.whoami.remote() for h in group.handles])
        assert [(i.rank, i.world_size) for i in infos] == [(0, 3), (1, 3), (2, 3)]
        assert {(i.master_addr, i.master_port) for i in infos} == {
            (infos[0].master_addr, infos[0].master_port)
        }
        assert infos[0].master_addr == "127.0.0.1" and infos[0].master_port > 0
        assert group.run("work", "ok") == 0  # rank 0's answer
    finally:
        group.kill()


def test_a_rank_that_cannot_start_is_named_and_the_others_are_stopped(ray_local):
    with pytest.raises(
        WorkerGroupError, match=r"g rank 1 failed during start-up: constructor failed: .*rank 1 cannot start"
    ):
        _group(ray_local, fail_rank=1)


def test_a_failing_peer_is_named_and_breaks_the_leader_out_of_its_wait(ray_local):
    group = _group(ray_local)
    peers = group.peers()

    def leader_waits_for_peers():  # like a collective: returns only when every peer is gone
        while not all(_dead(h) for h in peers.handles):
            time.sleep(0.2)
        raise RuntimeError("connection closed by peer")

    started = time.monotonic()
    with pytest.raises(WorkerGroupError) as info:
        peers.run("work", "fail1", local=leader_waits_for_peers)
    text = str(info.value)
    assert text.startswith(
        "g rank 1 failed during work: ValueError: boom; rank 0 then failed with RuntimeError"
    ), text
    assert time.monotonic() - started < BLAME_GRACE_S + 60
    assert all(_dead(h) for h in peers.handles)
    with pytest.raises(WorkerGroupError, match="worker group is stopped"):
        peers.run("work", "ok", local=lambda: 0)
    group.kill()


def test_a_failing_leader_with_stuck_peers_names_the_leader_and_stops_them(ray_local):
    group = _group(ray_local)
    peers = group.peers()

    def leader_fails():
        raise RuntimeError("leader broke")

    with pytest.raises(
        WorkerGroupError,
        match=r"g rank 0 failed during work: RuntimeError: leader broke; "
        r"rank\(s\) \[1\] had not finished",
    ):
        peers.run("work", "hang1", local=leader_fails)
    assert all(_dead(h) for h in peers.handles)
    group.kill()


def test_the_same_error_on_every_rank_is_reraised_and_the_group_kept(ray_local):
    group = _group(ray_local)
    peers = group.peers()

    def leader_fails():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        peers.run("work", "fail1", local=leader_fails)
    assert peers.run("work", "ok", local=lambda: "leader") == "leader"
    group.kill()
