"""Every built-in weight-sync transport passes the transport suite: in-process, object store and disk
with local trainer and engines (a stuck engine), broadcast between actors (a killed engine)."""

import sys

import pytest
import ray

from relax.core.config import load_config
from relax.core.controller.contexts import engine_context, trainer_context
from relax.core.controller.roles import RolloutRole, TrainerRole
from relax.core.testing.transport import WeightSyncConformance
from relax.core.weight_sync import BroadcastSync, DiskSync, InProcessSync, ObjectStoreSync

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TestInProcessConformance(WeightSyncConformance):
    timeout_s = 3.0  # local objects: the stuck-engine check waits this long

    def make_transport(self, timeout_s, bucket_bytes):
        return InProcessSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class TestDiskConformance(WeightSyncConformance):
    timeout_s = 3.0  # local objects: the stuck-engine check waits this long

    def make_transport(self, timeout_s, bucket_bytes):
        return DiskSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class TestObjectStoreConformance(WeightSyncConformance):
    timeout_s = 3.0  # local objects: the stuck-engine check waits this long

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _ray(cls, ray_local):
        return ray_local

    def make_transport(self, timeout_s, bucket_bytes):
        return ObjectStoreSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)


class TestBroadcastConformance(WeightSyncConformance):
    """As deployed: the trainer is a ``TrainerRole`` actor that pushes (trainer-sourced, the driver
    only orchestrates) to ``RolloutRole`` actors hosting the HF engine."""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _ray(cls, ray_local):
        return ray_local

    def make_transport(self, timeout_s, bucket_bytes):
        return BroadcastSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes, backend="gloo")

    def make_receiver_engine(self, model_dir, index):
        cfg = load_config(None, [f"model.path={model_dir}", "rollout.num_engines=2"])
        return RolloutRole.options(num_cpus=0, max_concurrency=4).remote(
            cfg, engine_context(cfg, model_dir, index)
        )

    def make_sender_trainer(self, model_dir):
        cfg = load_config(None, [f"model.path={model_dir}"])
        return TrainerRole.options(num_cpus=0).remote(cfg, trainer_context(cfg, model_dir))
