"""The world-2 (and world-4) fsdp trainers the rank tests share: Ray actor processes (gloo), started once per
session (their imports are most of a world's cost); each test builds the trainer it needs on them."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

from relax.core.testing.trainer import exported

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Rank:
    """One rank of a world-N fsdp trainer; every method is called on all ranks together."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.trainer = None

    def build(self, make: Callable[..., Any], model_dir: str, rank: int, world: int, port: int) -> None:
        """``make(model_dir, rank, world_size, port)``: this rank's trainer (the previous one closed)."""
        self.close()
        self.trainer = make(model_dir, rank, world, port)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.trainer, method)(*args)

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.trainer, *args)

    def export(self) -> Any:
        """Rank 0: the exported weights by name; the others take part in the gathers."""
        return (
            exported(self.trainer)
            if self.trainer.rank == 0
            else sum(1 for _ in self.trainer.export_weights())
        )

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """``world.build(make, model_dir)``, then ``world.<Rank method>(...)`` on every rank: rank 0's answer."""

    def __init__(self, size: int = 2) -> None:
        self.ranks = [Rank.remote() for _ in range(size)]

    def build(self, make: Callable[..., Any], model_dir: str) -> None:
        port, size = free_port(), len(self.ranks)
        ray.get(
            [r.build.remote(make, model_dir, i, size, port) for i, r in enumerate(self.ranks)], timeout=300
        )

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def on_all(*args: Any) -> Any:
            return ray.get([getattr(r, method).remote(*args) for r in self.ranks], timeout=300)[0]

        return on_all


def _close(world: World) -> None:
    for r in world.ranks:  # at the session's end: Ray may have been restarted since, taking the actors along
        with contextlib.suppress(Exception):
            ray.get(r.close.remote(), timeout=60)
        with contextlib.suppress(Exception):
            ray.kill(r)


@pytest.fixture(scope="session")
def world2(ray_local):
    world = World(2)
    yield world
    _close(world)


@pytest.fixture(scope="session")
def world4(ray_local):
    """Four ranks (data x context parallelism); only the tests that need them start them."""
    world = World(4)
    yield world
    _close(world)
