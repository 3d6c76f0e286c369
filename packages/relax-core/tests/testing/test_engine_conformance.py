"""The built-in HF engine passes the rollout-engine conformance suite."""

from relax.core.engines.hf import HFRolloutEngine
from relax.core.testing import RolloutEngineConformance


class TestHFEngineConformance(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)


class TestHFEngineChunkedConformance(RolloutEngineConformance):
    """More requests than ``max_batch_size``: the engine decodes them in chunks."""

    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir, max_batch_size=2)
