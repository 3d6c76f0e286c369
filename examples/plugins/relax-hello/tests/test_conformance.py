from relax_hello.engine import CountingEngine, CountingParams
from relax_hello.reward import LengthParams, LengthReward
from relax_hello.transport import ChecksumSync

from relax.core.context import PluginContext
from relax.core.data import Sample
from relax.core.testing import RewardConformance, RolloutEngineConformance, WeightSyncConformance


class TestCountingEngine(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return CountingEngine(CountingParams(), PluginContext(role="rollout", model_path=model_dir))


class TestLengthReward(RewardConformance):
    def make_reward(self):
        return LengthReward(LengthParams(target=2), PluginContext(role="reward"))

    def samples(self):
        return [
            Sample(prompt_ids=[1], group_id=0, index_in_group=i, response_ids=[7] * n)
            for i, n in enumerate([0, 2, 3])
        ]

    def expected_scores(self):
        return [-1.0, 0.0, -0.5]


class TestChecksumSync(WeightSyncConformance):
    timeout_s = 3.0  # local engines: the stuck-engine check waits this long

    def make_transport(self, timeout_s, bucket_bytes):
        return ChecksumSync(timeout_s=timeout_s, bucket_bytes=bucket_bytes)
