"""The end of a run closes what each process holds: a transport's sides in the trainer's and the
engines' processes (here: the disk transport's temporary directory, made by the sender in the
trainer's process), the driver's own instance, and every plugin object with ``close()`` -- one
failing or dead role never stops the others."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray
import torch

from relax.core.controller import closing
from relax.core.weight_sync import DiskSync, serve_receiver, serve_sender

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(180)
STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}


class Trainer:
    def export_weights(self, bucket_bytes: int = 64 << 20):
        yield list(STATE.items())


class Engine:
    def __init__(self) -> None:
        self.version, self.closed = -1, 0

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def weight_version(self) -> int:
        return self.version

    def close(self) -> None:
        self.closed += 1


class Role:
    """A role as ``controller.roles`` defines one: the plugin object, the weight-sync endpoints, and
    ``close()`` through ``closing.close_held``."""

    def __init__(self) -> None:
        self.trainer, self.engine = Trainer(), Engine()

    def weight_sender(self, spec, method: str, *args):
        yield from serve_sender(self, self.trainer, spec, method, *args)

    def weight_receiver(self, spec, method: str, *args):
        return serve_receiver(self, self.engine, spec, method, *args)

    def close(self) -> None:
        closing.close_held(self, self.engine)

    def sides(self) -> list[str]:
        """The temporary directories of the transport sides kept in this process."""
        return [
            getattr(side, "_tmpdir", None) for _, side in self.__dict__.get("_relax_weight_sync", {}).values()
        ]

    def engine_closed(self) -> int:
        return self.engine.closed

    def hang(self) -> None:
        time.sleep(60)


RoleActor = ray.remote(num_cpus=0, max_concurrency=4)(Role)


def test_closing_the_roles_removes_the_trainer_sides_temp_dir_and_closes_the_plugins(ray_local):
    sync = DiskSync(timeout_s=30)  # no directory: the sender makes a temporary one in its own process
    trainer, engine = RoleActor.remote(), RoleActor.remote()
    try:
        assert sync.sync(trainer, [engine], 1)["engines"] == 1
        (tmpdir,) = [d for d in ray.get(trainer.sides.remote()) if d]
        assert os.path.isdir(os.path.join(tmpdir, "v00000001"))
        closing.close_roles([trainer, engine, engine], timeout_s=30)  # the same handle twice: closed once
        assert not os.path.exists(tmpdir)
        assert ray.get(trainer.sides.remote()) == [] and ray.get(engine.sides.remote()) == []
        assert ray.get(engine.engine_closed.remote()) == 1
    finally:
        sync.close()
        ray.kill(trainer)
        ray.kill(engine)


def test_a_local_trainer_sends_from_the_drivers_instance_which_close_cleans(tmp_path):
    sync, engine = DiskSync(timeout_s=30), Engine()
    sync.sync(Trainer(), [engine], 3)
    assert engine.weight_version() == 3 and sync._tmpdir is not None and os.path.isdir(sync._tmpdir)
    made = sync._tmpdir
    sync.close()
    assert not os.path.exists(made)


def test_a_dead_or_silent_role_is_skipped_within_the_deadline_and_the_rest_still_close(ray_local):
    dead, fine = RoleActor.remote(), RoleActor.remote()
    ray.get([dead.__ray_ready__.remote(), fine.__ray_ready__.remote()])
    ray.kill(dead)
    silent_close = RoleActor.options(max_concurrency=1).remote()
    silent_close.hang.remote()  # one thread, busy: its close() cannot run in time
    try:
        started = time.monotonic()
        closing.close_roles([dead, silent_close, fine], timeout_s=2)
        assert time.monotonic() - started < 2 + 5
        assert ray.get(fine.engine_closed.remote()) == 1
    finally:
        for actor in (silent_close, fine):
            ray.kill(actor)


def test_run_all_runs_every_part_and_logs_the_failures(caplog):
    done = []

    def fails():
        raise OSError("disk gone")

    closing.run_all(
        [
            ("first", lambda: done.append(1)),
            ("the transport", fails),
            ("skipped", None),
            ("last", lambda: done.append(2)),
        ]
    )
    assert done == [1, 2]
    assert "closing the transport failed: OSError: disk gone" in caplog.text
