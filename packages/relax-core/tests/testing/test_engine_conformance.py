"""The built-in HF engine passes the rollout-engine conformance suite."""

from relax.core.engines.hf import HFRolloutEngine
from relax.core.testing import RolloutEngineConformance


class TestHFEngineConformance(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)
