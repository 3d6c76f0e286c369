from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from relax.core.algorithms import build_policy_objective, entropy_from_logits, logprobs_from_logits
from relax.core.hookspecs import hookimpl
from relax.core.policy_update import PolicyUpdate, UpdateSettings


class SGDTrainer:  # one process, plain SGD: the model step; core's PolicyUpdate loop is its train_step
    dp_rank, dp_size = 0, 1

    def __init__(self, model_path, settings, objective=None):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.optimizer, self.temperature = torch.optim.SGD(self.model.parameters()), settings.temperature
        self.update = PolicyUpdate(self, settings, objective)

    def forward(self, b):  # (B, R) logprobs and entropy: positions P-1 .. P+R-2 predict the response
        logits = self.model(**{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        logits = logits[:, -b["responses"].shape[1] - 1 : -1] / self.temperature
        return logprobs_from_logits(logits, b["responses"]), entropy_from_logits(logits)

    @torch.no_grad()
    def score(self, b):
        return torch.where(b["response_mask"] > 0, self.forward(b)[0], 0.0)

    def forward_backward(self, micro_batches, loss_fn):
        records = []
        for micro in micro_batches:
            loss, record = loss_fn(micro, *self.forward(micro))
            loss.backward()
            records.append(record)
        return records

    def finish_gradients(self, max_norm):
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def apply_gradients(self, lr):
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def all_reduce_sum(self, values):
        return values  # one replica: nothing to sum over

    def local_rows(self, batch):
        return batch

    def forward_logprobs(self, batch):
        return self.score(batch)

    def train_step(self, batch):
        return self.update.train_step(batch)

    def export_weights(self, bucket_bytes=64 << 20):  # one tensor per bucket
        return ([(name, tensor.detach())] for name, tensor in self.model.state_dict().items())

    def save(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "step": self.update.step}, Path(directory) / "sgd.pt")

    def load(self, directory):
        state = torch.load(Path(directory) / "sgd.pt")
        self.model.load_state_dict(state["model"])
        self.update.step = state["step"]


@hookimpl
def relax_register_trainers(register):  # trainer.backend: sgd
    register(
        "sgd",
        lambda params, ctx: SGDTrainer(
            ctx.model_path,
            UpdateSettings.from_context(ctx),
            build_policy_objective(ctx.train.algorithm) if ctx.train.trainable else None,
        ),
    )
