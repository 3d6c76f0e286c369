"""``WeightSyncConformance``: a transport delivers the trainer's weights bit-identically, the engines
serve the new version, and a dead or stuck engine is an error naming it within the deadline.

The fleet is one sender trainer built on ``other_model_dir`` and ``num_engines`` receiver engines
built on ``model_dir``, so a sync visibly changes what the engines hold. By default both are local
objects (core's torch trainer and HF engine); override ``make_receiver_engine`` /
``make_sender_trainer`` to use Ray actors (e.g. core's ``RolloutRole`` / ``TrainerRole``) or your
own engine. Engines are named in errors as ``engine[i]`` (``relax.core.weight_sync.base.engine_names``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams, WeightSync
from relax.core.testing.models import TinyModelFixtures, load_hf_weights
from relax.core.weight_sync import WeightSyncError


def _is_actor(obj: Any) -> bool:
    from ray.actor import ActorHandle

    return isinstance(obj, ActorHandle)


class WeightSyncConformance(TinyModelFixtures):
    """Subclass as ``class TestMyTransport(WeightSyncConformance)`` and implement ``make_transport``.

    The tests share one fleet per class and run in order; the last one breaks ``engine[-1]``.
    """

    num_engines: int = 2
    #: the transport's deadline (``ctx.timeout_s``); the dead-engine test waits a few times this
    timeout_s: float = 10.0
    #: small buckets: a sync of the tiny model (~1.2 MB) takes several
    bucket_bytes: int = 1 << 18

    # ------------------------------------------------------------------ what a subclass provides
    def make_transport(self, timeout_s: float, bucket_bytes: int) -> WeightSync:
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_transport(self, timeout_s, bucket_bytes)"
        )

    def make_receiver_engine(self, model_dir: str, index: int) -> Any:
        """Engine ``index`` of the fleet (a local object or a Ray actor handle the transport serves)."""
        from relax.core.engines.hf import HFRolloutEngine

        return HFRolloutEngine(model_dir)

    def make_sender_trainer(self, model_dir: str) -> Any:
        from relax.core.testing.trainer import torch_trainer

        return torch_trainer(model_dir)

    def close(self, obj: Any) -> None:
        """Release an engine or the trainer (default: kill an actor, nothing for a local object)."""
        if _is_actor(obj):
            import ray

            ray.kill(obj)

    def served_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """What ``engine`` serves, by HF name (default: its ``state_dict()``, as core's HF engine has)."""
        if _is_actor(engine):
            import ray

            return ray.get(engine.call.remote("state_dict"), timeout=120)
        if not callable(getattr(engine, "state_dict", None)):
            pytest.skip(f"{type(engine).__name__} has no state_dict(): override served_weights")
        return engine.state_dict()

    def weight_version(self, engine: Any) -> int:
        if _is_actor(engine):
            import ray

            return ray.get(engine.weight_version.remote(), timeout=120)
        return engine.weight_version()

    def generate(self, engine: Any, requests: list[GenerationRequest]) -> list[Any]:
        if _is_actor(engine):
            import ray

            return ray.get(engine.generate.remote(requests), timeout=120)
        return asyncio.run(engine.generate(requests))

    def break_engine(self, engine: Any, release: threading.Event) -> None:
        """Make ``engine`` fail a sync: kill an actor; make a local engine's ``update_weights`` hang
        (until ``release`` is set at teardown) -- a stuck engine."""
        if _is_actor(engine):
            import ray

            ray.kill(engine, no_restart=True)
            return

        def stuck(*args: Any, **kwargs: Any) -> None:
            release.wait()

        engine.update_weights = stuck

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def fleet(cls, model_dir: str, other_model_dir: str) -> Iterator[dict[str, Any]]:
        suite = cls()
        release = threading.Event()
        trainer = suite.make_sender_trainer(other_model_dir)
        engines = [suite.make_receiver_engine(model_dir, i) for i in range(suite.num_engines)]
        transport = suite.make_transport(suite.timeout_s, suite.bucket_bytes)
        yield {"transport": transport, "trainer": trainer, "engines": engines, "release": release}
        release.set()
        for obj in [*engines, trainer]:
            suite.close(obj)
        close = getattr(transport, "close", None)
        if callable(close):
            close()

    def _next_version(self, engines: list[Any]) -> int:
        return max(self.weight_version(e) for e in engines) + 1

    # ------------------------------------------------------------------ the contract
    def test_is_a_weight_sync(self, fleet):
        assert isinstance(fleet["transport"], WeightSync), (
            f"{type(fleet['transport']).__name__} has no sync()"
        )

    def test_sync_delivers_bit_identical_weights_and_serves_the_version(self, fleet, other_model_dir):
        transport, trainer, engines = fleet["transport"], fleet["trainer"], fleet["engines"]
        expected = load_hf_weights(other_model_dir)  # what the sender trainer was built from
        before = self.served_weights(engines[0])
        same = sorted(n for n, t in expected.items() if n in before and torch.equal(before[n].cpu(), t))
        assert not same, (
            f"precondition: the engines start with weights that differ from the trainer's in every tensor, {same[:3]} do not"
        )
        version = self._next_version(engines)
        stats = transport.sync(trainer, engines, version)
        assert isinstance(stats, dict) and all(isinstance(v, float | int) for v in stats.values()), stats
        for i, engine in enumerate(engines):
            assert self.weight_version(engine) == version, f"engine[{i}] does not report version {version}"
            served = self.served_weights(engine)
            missing = sorted(set(expected) - set(served))
            assert not missing, f"engine[{i}] lacks {missing[:5]}"
            for name, tensor in expected.items():
                got = served[name]
                assert got.dtype == tensor.dtype and torch.equal(got.cpu(), tensor), (
                    f"engine[{i}] {name}: not bit-identical to the trainer's weights after sync"
                )
            params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=i)
            (result,) = self.generate(engine, [GenerationRequest("after-sync", [4, 5, 6], params)])
            assert result.versions == [version] * 4, f"engine[{i}] sampled with versions {result.versions}"

    def test_resync_serves_the_next_version(self, fleet, other_model_dir):
        transport, trainer, engines = fleet["transport"], fleet["trainer"], fleet["engines"]
        for _ in range(2):
            version = self._next_version(engines)
            transport.sync(trainer, engines, version)
            assert [self.weight_version(e) for e in engines] == [version] * len(engines)
        served = self.served_weights(engines[-1])
        for name, tensor in load_hf_weights(other_model_dir).items():
            assert torch.equal(served[name].cpu(), tensor), f"{name} changed on a sync of unchanged weights"

    def test_dead_engine_is_named_within_the_timeout(self, fleet):
        """Runs last in the class: it breaks ``engine[-1]`` for good."""
        transport, trainer, engines = fleet["transport"], fleet["trainer"], fleet["engines"]
        version = self._next_version(engines)
        broken = len(engines) - 1
        self.break_engine(engines[broken], fleet["release"])
        budget = 3 * self.timeout_s + 30.0
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            transport.sync(trainer, engines, version)
        elapsed = time.monotonic() - start
        assert f"engine[{broken}]" in str(err.value), f"the error must name engine[{broken}]: {err.value}"
        assert elapsed < budget, f"the sync failed only after {elapsed:.0f}s (timeout_s={self.timeout_s:g})"
