"""The example trainer backend of docs/plugins.md: core's trainer kit (the ``Trainer`` methods and the
``ModelStep`` backend protocol), a few train steps through core's loop, and its registration hook."""

from relax_hello import trainer as hello_trainer
from relax_hello.trainer import SGDTrainer

from relax.core.algorithms import build_policy_objective
from relax.core.algorithms.config import AlgorithmConfig
from relax.core.config import TrainerConfig
from relax.core.context import PluginContext, TrainSpec
from relax.core.plugins import RelaxPluginManager
from relax.core.policy_update import UpdateSettings
from relax.core.testing import TinyModelFixtures, TrainerConformance, make_batch, make_samples


def sgd_trainer(model_dir, lr=1e-2):
    return SGDTrainer(
        model_dir, UpdateSettings(lr=lr, micro_batch_size=4), build_policy_objective(AlgorithmConfig())
    )


class TestSGDTrainer(TrainerConformance):
    def make_trainer(self, model_dir):
        return sgd_trainer(model_dir)


class TestTrainingSteps(TinyModelFixtures):
    def test_steps_raise_the_advantage_weighted_logprobs(self, model_dir, tokenizer):
        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        trainer = sgd_trainer(model_dir, lr=0.1)
        gains = [float((trainer.forward_logprobs(batch) * batch["advantages"]).sum())]
        for _ in range(3):
            metrics = trainer.train_step(dict(batch))  # no old_logprobs: the loop scores them
            assert metrics["lr"] == 0.1 and metrics["grad_norm"] > 0 and metrics["skipped_nonfinite"] == 0.0
            gains.append(float((trainer.forward_logprobs(batch) * batch["advantages"]).sum()))
        assert gains[-1] > gains[0] + 1e-3, gains
        assert trainer.update.step == 3

    def test_registered_through_relax_register_trainers(self, model_dir, tokenizer):
        manager = RelaxPluginManager(extra_plugins={"hello_trainer": hello_trainer}, load_entry_points=False)
        spec = TrainSpec(
            optim=TrainerConfig(lr=0.05, micro_batch_size=3), algorithm=AlgorithmConfig(), total_steps=2
        )
        trainer = manager.registration("trainer", "sgd").factory(
            None, PluginContext(role="trainer", model_path=model_dir, train=spec)
        )
        assert isinstance(trainer, SGDTrainer)
        assert (trainer.update.settings.lr, trainer.update.settings.micro_batch_size) == (0.05, 3)
        batch = make_batch(make_samples(tokenizer, rows=4), tokenizer.pad_token_id)
        assert trainer.train_step(batch)["lr"] == 0.05
