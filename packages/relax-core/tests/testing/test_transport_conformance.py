"""Every built-in weight-sync transport passes the transport suite: in-process, object store and disk
with local trainer and engines (a stuck engine), broadcast with engine actors (a killed one)."""

import sys

import pytest
import ray

from relax.core.config import load_config
from relax.core.controller.contexts import engine_context
from relax.core.controller.roles import RolloutRole
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
    """Engines are real ``RolloutRole`` actors hosting the HF engine (broadcast needs processes)."""

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
