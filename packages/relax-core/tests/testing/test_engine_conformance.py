"""The built-in HF engine passes the rollout-engine conformance suite."""

import pytest

from relax.core.engines.hf import HFRolloutEngine
from relax.core.testing import RolloutEngineConformance


class TestHFEngineConformance(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)


class TestHFEngineChunkedConformance(RolloutEngineConformance):
    """More requests than ``max_batch_size``: the engine decodes them in chunks."""

    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir, max_batch_size=2)

    @pytest.mark.xfail(
        strict=True,
        reason="engines/hf.py bug: abort() ends only the chunk being decoded; later chunks of the same "
        "generate() call start afterwards with the new abort epoch and run to completion",
    )
    def test_abort_ends_in_flight_requests(self, engine, prompts):
        super().test_abort_ends_in_flight_requests(engine, prompts)
