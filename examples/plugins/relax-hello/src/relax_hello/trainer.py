from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from relax.core.algorithms import entropy_from_logits, logprobs_from_logits
from relax.core.hookspecs import hookimpl
from relax.core.policy_update import PolicyUpdate
from relax.core.trainers.policy_trainer import OneProcessTrainer, loop_inputs


class SGDTrainer(OneProcessTrainer):  # one process, plain SGD; core's PolicyUpdate loop is its train_step
    def __init__(self, model_path, settings, objective=None):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.optimizer, self.temperature = torch.optim.SGD(self.model.parameters()), settings.temperature
        self.update = PolicyUpdate(self, settings, objective)

    def forward(self, b):  # (B, R) logprobs and entropy: positions P-1 .. P+R-2 predict the response
        logits = self.model(**{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        logits = logits[:, -b["responses"].shape[1] - 1 : -1] / self.temperature
        return logprobs_from_logits(logits, b["responses"]), entropy_from_logits(logits)

    def export_weights(self, bucket_bytes=64 << 20):  # one tensor per bucket
        return ([(name, tensor.detach())] for name, tensor in self.model.state_dict().items())

    def save(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "step": self.step}, Path(directory) / "sgd.pt")

    def load(self, directory):
        state = torch.load(Path(directory) / "sgd.pt")
        self.model.load_state_dict(state["model"])
        self.step = state["step"]


@hookimpl
def relax_register_trainers(register):  # trainer.backend: sgd
    register("sgd", lambda params, ctx: SGDTrainer(ctx.model_path, *loop_inputs(ctx)))
