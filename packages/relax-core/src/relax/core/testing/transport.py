"""``WeightSyncConformance``: a transport delivers the trainer's weights bit-identically, the engines
serve the new version, and a dead or stuck engine is an error naming it within the deadline.

The fleet is one sender trainer built on ``other_model_dir`` and ``num_engines`` receiver engines
built on ``model_dir``, so a sync visibly changes what the engines hold. By default both are local
objects (core's torch trainer and HF engine); override ``make_receiver_engine`` /
``make_sender_trainer`` to use Ray actors (e.g. core's ``RolloutRole`` / ``TrainerRole``) or your
own engine. Engines are named in errors as ``engine[i]`` (``relax.core.weight_sync.base.engine_names``).
The fleet runs with Python's temporary directory pointed at a fresh one, so files a sync leaves
behind are counted without other processes' noise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams, WeightSync
from relax.core.testing.models import TinyModelFixtures, load_hf_weights
from relax.core.weight_sync import WeightSyncError


def _is_actor(obj: Any) -> bool:
    from ray.actor import ActorHandle

    return isinstance(obj, ActorHandle)


@contextmanager
def scratch_tempdir() -> Iterator[str]:
    """A fresh directory as ``tempfile``'s default while the block runs (removed afterwards)."""
    scratch, saved = tempfile.mkdtemp(prefix="relax-kit-"), tempfile.tempdir
    tempfile.tempdir = scratch
    try:
        yield scratch
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(scratch, ignore_errors=True)


def count_entries(directories: list[str]) -> dict[str, int]:
    """Files and directories under each of ``directories`` (recursively), by directory."""
    return {d: sum(len(dirs) + len(files) for _, dirs, files in os.walk(d)) for d in directories}


class EngineRefused(RuntimeError):
    """What a deliberately failing engine raises from ``update_weights``."""


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

    def fail_engine(self, engine: Any) -> str | None:
        """Make ``engine`` raise when it is given weights, until :meth:`heal_engine`; return a piece of
        text the sync's error must then carry (None: only the engine's name is checked). Default, for
        a local engine: each of its ``update_weights*`` methods raises ``EngineRefused`` (override for
        actors, else the test is skipped)."""
        if _is_actor(engine):
            pytest.skip("override fail_engine/heal_engine to make an actor's weight update raise")
        message = "conformance: engine refuses this update"

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise EngineRefused(message)

        for name in dir(engine):
            if name.startswith("update_weights") and callable(getattr(engine, name, None)):
                setattr(engine, name, refuse)
        return message

    def heal_engine(self, engine: Any) -> None:
        """Undo :meth:`fail_engine`."""
        for name in [n for n in vars(engine) if n.startswith("update_weights")]:
            delattr(engine, name)

    def scratch_dirs(self, fleet: dict[str, Any]) -> list[str]:
        """Where the transport may leave files: the fleet's temporary directory, plus the directory
        its params name (``params.directory``, e.g. disk or shared memory), if any."""
        configured = getattr(getattr(fleet["transport"], "params", None), "directory", None)
        return [
            fleet["scratch"],
            *([configured] if isinstance(configured, str) and os.path.isdir(configured) else []),
        ]

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def fleet(cls, model_dir: str, other_model_dir: str) -> Iterator[dict[str, Any]]:
        suite = cls()
        release = threading.Event()
        with scratch_tempdir() as scratch:
            trainer = suite.make_sender_trainer(other_model_dir)
            engines = [suite.make_receiver_engine(model_dir, i) for i in range(suite.num_engines)]
            transport = suite.make_transport(suite.timeout_s, suite.bucket_bytes)
            yield {
                "transport": transport,
                "trainer": trainer,
                "engines": engines,
                "release": release,
                "scratch": scratch,
            }
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

    def test_repeated_syncs_leave_no_files_behind(self, fleet):
        """What a sync writes (version directories, segments) is reused or removed: the number of
        files does not grow with the number of syncs (two first, so a keep-N scheme fills up)."""
        transport, trainer, engines = fleet["transport"], fleet["trainer"], fleet["engines"]
        for _ in range(2):
            transport.sync(trainer, engines, self._next_version(engines))
        dirs = self.scratch_dirs(fleet)
        before = count_entries(dirs)
        for _ in range(3):
            transport.sync(trainer, engines, self._next_version(engines))
        after = count_entries(dirs)
        grown = {d: after[d] - before[d] for d in dirs if after[d] > before[d]}
        assert not grown, f"3 more syncs left more files behind (new entries per directory: {grown})"

    def test_engine_error_is_raised_naming_it(self, fleet):
        """An engine whose update raises fails the sync within the deadline, with that engine's name
        and error: a transport that swallows it would fail only later (a version check) or never."""
        transport, trainer, engines = fleet["transport"], fleet["trainer"], fleet["engines"]
        version = self._next_version(engines)
        expected = self.fail_engine(engines[0])
        start = time.monotonic()
        try:
            with pytest.raises(WeightSyncError) as err:
                transport.sync(trainer, engines, version)
        finally:
            self.heal_engine(engines[0])
        elapsed, text = time.monotonic() - start, str(err.value)
        assert "engine[0]" in text, f"the error must name engine[0]: {text}"
        assert expected is None or expected in text, (
            f"the error must carry the engine's own error {expected!r}: {text}"
        )
        assert elapsed < self.timeout_s + 5.0, (
            f"the engine failed at once, the sync only after {elapsed:.1f}s (timeout_s={self.timeout_s:g})"
        )

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
