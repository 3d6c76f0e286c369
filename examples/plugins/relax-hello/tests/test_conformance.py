from relax.core.context import PluginContext
from relax.core.testing.engine import RolloutEngineConformance
from relax_hello.engine import CountingEngine, CountingParams


class TestCountingEngine(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return CountingEngine(CountingParams(), PluginContext(role="rollout", model_path=model_dir))
