"""``shared_memory`` weight sync: conformance (local trainer and engines), the trainer/engine
equality after each train step, a stale segment refused, and mutants that skip the copy caught."""

from __future__ import annotations

import os

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.testing.models import TinyModelFixtures
from relax.core.testing.trainer import torch_trainer
from relax.core.testing.transport import WeightSyncConformance
from relax.core.weight_sync import SharedMemorySync, WeightSyncError


class TestSharedMemoryConformance(WeightSyncConformance):
    timeout_s = 3.0  # local objects: the stuck-engine check waits this long

    def make_transport(self, timeout_s, bucket_bytes):
        return SharedMemorySync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class SkipsCopy(SharedMemorySync):
    """Mutant: stamps the new version but never copies the weights after the first sync."""

    synced = False

    def _segment_for(self, size):
        path, flat = super()._segment_for(size)
        if self.synced:
            flat = torch.empty_like(flat)  # the copy lands in a scratch buffer; the stamp too
        self.synced = True
        return path, flat


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            prompt_ids=torch.randint(4, 20, (4,), generator=g).tolist(),
            group_id=i // 2,
            response_ids=torch.randint(4, 20, (3,), generator=g).tolist(),
        )
        for i in range(4)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = (
        torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(batch["response_mask"]).clone()
    )
    return batch


def _differing(engine, trainer) -> list[str]:
    served = engine.state_dict()
    return [n for n, t in trainer.state_dict_for_sync().items() if not torch.equal(served[n], t)]


class TestAfterEachStep(TinyModelFixtures):
    def test_engine_equals_trainer_after_each_step_and_a_skipped_copy_is_caught(self, model_dir, tmp_path):
        from relax.core.engines.hf import HFRolloutEngine

        trainer, engine = torch_trainer(model_dir), HFRolloutEngine(model_dir)
        sync = SharedMemorySync(timeout_s=10, bucket_bytes=1 << 18, directory=str(tmp_path))
        for version in (1, 2, 3):
            trainer.train_step(_batch(version))
            stats = sync.sync(trainer, [engine], version)
            assert engine.weight_version() == version and stats["buckets"] > 1
            assert _differing(engine, trainer) == [], f"engine differs from the trainer after step {version}"
        (segment,) = os.listdir(tmp_path)  # one reused segment
        sync.close()
        assert os.listdir(tmp_path) == [], f"segment {segment} left behind after close()"

        mutant = SkipsCopy(timeout_s=10, bucket_bytes=1 << 18, directory=str(tmp_path))
        mutant.sync(trainer, [engine], 4)
        trainer.train_step(_batch(4))
        with pytest.raises(WeightSyncError, match=r"holds version 4, not 5.*refusing to apply stale weights"):
            mutant.sync(trainer, [engine], 5)
        assert engine.weight_version() == 4 and _differing(engine, trainer), "the stale segment was applied"
        mutant.close()

    def test_resending_the_first_export_is_caught_by_the_equality_check(self, model_dir, tmp_path):
        """Mutant 2: the sender keeps sending its first export under each new version; the segment
        is stamped correctly, so only the trainer/engine equality after a step can catch it."""
        from relax.core.engines.hf import HFRolloutEngine

        class Fixed:
            def __init__(self, buckets):
                self.buckets = buckets

            def export_weights(self, bucket_bytes):
                return iter(self.buckets)

        class ResendsFirstExport(SharedMemorySync):
            cached = None

            def push(self, trainer, engines, version):
                if self.cached is None:
                    self.cached = [
                        [(n, t.clone()) for n, t in b] for b in trainer.export_weights(self.bucket_bytes)
                    ]
                yield from super().push(Fixed(self.cached), engines, version)

        trainer, engine = torch_trainer(model_dir), HFRolloutEngine(model_dir)
        for transport, caught in ((SharedMemorySync, False), (ResendsFirstExport, True)):
            sync = transport(timeout_s=10, bucket_bytes=1 << 18, directory=str(tmp_path))
            sync.sync(trainer, [engine], 1)
            trainer.train_step(_batch(1))
            sync.sync(trainer, [engine], 2)
            assert engine.weight_version() == 2
            assert bool(_differing(engine, trainer)) is caught
            sync.close()


def test_driver_close_removes_the_segment_a_killed_sender_left(tmp_path):
    driver = SharedMemorySync(directory=str(tmp_path))
    sender = SharedMemorySync(driver.params, driver.ctx)
    sender.uid = driver.uid  # as the trainer actor rebuilds it from the driver's spec
    sender._segment_for(1 << 12)
    sender._cleanup.detach()  # killed: its own clean-up never runs
    other = SharedMemorySync(directory=str(tmp_path))
    other._segment_for(1 << 12)
    assert len(os.listdir(tmp_path)) == 2
    driver.close()
    assert os.listdir(tmp_path) == [os.path.basename(other._segment[0])]  # only its own transport's
    other.close()
    assert os.listdir(tmp_path) == []


def test_missing_segment_names_the_machine_requirement(tmp_path):
    from relax.core.weight_sync.shared_memory import SharedMemoryReceiver

    class Engine:
        def update_weights(self, named, version): ...

        def weight_version(self):
            return 0

    receiver = SharedMemoryReceiver(SharedMemorySync(), Engine())
    with pytest.raises(WeightSyncError, match=r"not visible here.*every engine on the trainer's machine"):
        receiver.apply(str(tmp_path / "absent"), 128, [], 1)
    with pytest.raises(WeightSyncError, match=r"directory: .* is not a directory"):
        SharedMemorySync(directory=str(tmp_path / "nope"))._segment_for(128)
