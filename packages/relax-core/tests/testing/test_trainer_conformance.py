"""The built-in torch trainer passes the trainer suite, and agrees with the HF engine on logprobs."""

from relax.core.engines.hf import HFRolloutEngine
from relax.core.testing import LogprobAgreementConformance, TrainerConformance, torch_trainer


class TestTorchTrainerConformance(TrainerConformance):
    def make_trainer(self, model_dir):
        return torch_trainer(model_dir)


class TestHFEngineTorchTrainerAgreement(LogprobAgreementConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)

    def make_trainer(self, model_dir):
        return torch_trainer(model_dir)
