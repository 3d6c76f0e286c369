"""The disk transport checks that every engine sees its directory (a probe file the sender writes and
each new engine reads) before the first load, instead of assuming one filesystem; a one-machine
transport declares it (``Transport.reach``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax.core.weight_sync import TRANSPORTS, DiskReceiver, DiskSync, WeightSyncError
from relax.core.weight_sync.disk import PROBE


class Trainer:
    def export_weights(self, bucket_bytes: int = 64 << 20):
        yield [("w", torch.ones(3))]


class Engine:
    def __init__(self) -> None:
        self.version = -1

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def weight_version(self) -> int:
        return self.version


def test_each_new_engine_reads_the_probe_once_before_its_first_load(tmp_path):
    sync, first, second = DiskSync(directory=str(tmp_path / "weights"), timeout_s=30), Engine(), Engine()
    probed = []
    for engine in (first, second):  # what each engine's receiver was asked to read
        receiver = sync.local_receiver(engine)
        receiver.sees = lambda probe, token, engine=engine, check=receiver.sees: (
            probed.append((engine, Path(probe).read_text())),
            check(probe, token),
        )[1]
    sync.sync(Trainer(), [first], 1)
    assert probed == [(first, sync.uid)] and first.version == 1
    sync.sync(Trainer(), [first], 2)  # already checked: not probed again
    assert len(probed) == 1 and first.version == 2
    sync.sync(Trainer(), [first, second], 3)  # a new engine (another node, maybe): probed before it loads
    # the engines are asked concurrently, so in either order
    assert sorted(probed[1:], key=lambda seen: seen[0] is second) == [(first, sync.uid), (second, sync.uid)]
    assert second.version == 3
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "v00000002",
        "v00000003",
    ]  # probe removed
    sync.close()


def test_an_engine_that_cannot_see_the_directory_fails_naming_it(tmp_path):
    sync = DiskSync(directory=str(tmp_path / "weights"), timeout_s=30)
    receiver = DiskReceiver(sync, Engine())
    elsewhere = tmp_path / "not-mounted-here" / PROBE
    with pytest.raises(
        WeightSyncError,
        match=rf"weight_sync.params.directory {elsewhere.parent} is not visible from "
        r"this engine's node .* \(a shared filesystem\)",
    ):
        receiver.sees(str(elsewhere), sync.uid)
    stale = tmp_path / "weights" / PROBE
    stale.parent.mkdir()
    stale.write_text("another run's token")  # a same-named directory on another machine
    with pytest.raises(WeightSyncError, match="is not visible"):
        receiver.sees(str(stale), sync.uid)


def test_transports_declare_their_reach():
    assert {name: cls.reach for name, cls in TRANSPORTS.items()} == {
        "in_process": "cluster",
        "object_store": "cluster",
        "broadcast": "cluster",
        "disk": "shared_path",
        "shared_memory": "host",
    }
