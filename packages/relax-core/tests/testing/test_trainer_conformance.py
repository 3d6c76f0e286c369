"""The built-in torch trainer passes the trainer suite, and agrees with the HF engine on logprobs."""

from relax.core.algorithms import build_policy_objective
from relax.core.algorithms.config import AlgorithmConfig
from relax.core.engines.hf import HFRolloutEngine
from relax.core.testing.trainer import LogprobAgreementConformance, TrainerConformance
from relax.core.trainers.torch_trainer import TorchTrainer


def torch_trainer(model_dir):
    return TorchTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-2, micro_batch_size=4)


class TestTorchTrainerConformance(TrainerConformance):
    def make_trainer(self, model_dir):
        return torch_trainer(model_dir)


class TestHFEngineTorchTrainerAgreement(LogprobAgreementConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)

    def make_trainer(self, model_dir):
        return torch_trainer(model_dir)
