"""The trainer wrapper around core's policy-update loop, written once for every backend.

A backend is its own :class:`~relax.core.policy_update.ModelStep`. What turns it into a ``Trainer`` is the
same for all of them, so it lives here: the settings with a caller's overrides and the seeds
(:func:`seeded`), AdamW from the settings (:func:`adamw_from`), a factory's loop inputs from core's context
(:func:`loop_inputs`), and the glue to the loop (:class:`PolicyTrainer`: the checkpointed ``step``,
``current_lr``, ``train_step``). :class:`OneProcessTrainer` adds the rest of the model step for a
one-process backend with one torch optimizer that writes only ``forward`` (``docs/plugins.md``'s example).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from relax.core.policy_update import LossFn, ModelStep, Objective, PolicyUpdate, UpdateSettings
from relax.core.trainers.optim import adamw, clip_gradients, step_checked
from relax.core.trainers.response_forward import forward_backward

Batch = dict[str, Any]


def seed_all(seed: int) -> None:
    """Python's, numpy's and torch's RNGs from one seed (every rank the same: the same initial state)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seeded(settings: UpdateSettings | None, overrides: dict[str, Any]) -> UpdateSettings:
    """A constructor's prologue: ``settings`` (default ``UpdateSettings()``) with the keyword ``overrides`` a
    script or test passes, and the RNGs seeded from the result's ``seed``."""
    s = (settings or UpdateSettings()).with_overrides(**overrides)
    seed_all(s.seed)
    return s


def adamw_from(
    params: list[torch.nn.Parameter], s: UpdateSettings, device: torch.device | None = None
) -> torch.optim.AdamW:
    """AdamW at the settings' lr, betas, eps and weight decay; with ``device``, fused there (``optim.adamw``)."""
    kwargs = dict(lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, **kwargs) if device is None else adamw(params, device, **kwargs)


def loop_inputs(ctx: Any) -> tuple[UpdateSettings, Objective | None]:
    """A trainer factory's loop inputs from core's ``PluginContext``: the typed settings and the algorithm's
    policy objective (None for a frozen model: reference or teacher)."""
    from relax.core.algorithms import build_policy_objective

    objective = build_policy_objective(ctx.train.algorithm) if ctx.train.trainable else None
    return UpdateSettings.from_context(ctx), objective


class LoopBackend(ModelStep, Protocol):
    """What :class:`PolicyTrainer` needs from the class that uses it: the model step, the loop over it
    (``update = PolicyUpdate(self, ...)``) and its optimizer (None on a frozen model)."""

    update: PolicyUpdate
    optimizer: Any


class PolicyTrainer:
    """The ``Trainer`` glue around ``self.update`` (a :class:`LoopBackend`): the loop's ``step`` counter,
    ``current_lr`` and ``train_step``. ``device`` is where ``train_step`` moves a batch; a backend adds
    metrics taken before the update (e.g. MoE routing) by overriding :meth:`step_metrics`."""

    device = torch.device("cpu")

    @property
    def step(self) -> int:
        """``train_step`` calls so far (the loop's counter, the LR schedule's whole state; checkpointed)."""
        return self.update.step

    @step.setter
    def step(self, value: int) -> None:
        self.update.step = value

    def current_lr(self) -> float:
        return self.update.current_lr()

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One update of core's loop (:meth:`PolicyUpdate.train_step`) on this trainer's device, with
        :meth:`step_metrics` of the batch before the update."""
        if self.optimizer is None or self.update.objective is None:
            raise RuntimeError(f"train_step needs a trainable {type(self).__name__} with an objective")
        batch = self._on_device(batch)
        before = self.step_metrics(batch)
        return {**self.update.train_step(batch), **before}

    def step_metrics(self, batch: Batch) -> dict[str, float]:
        """Metrics of ``batch`` under the weights before the update; none by default."""
        return {}

    def _on_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class OneProcessTrainer(PolicyTrainer):
    """The model step of one process with one torch optimizer over ``self.model``, from the backend's
    ``forward(batch) -> (logprobs, entropy)``: (B, R) fp32 each, with grad, at the settings' temperature.
    The backend writes ``forward``, its constructor and the ``Trainer`` methods left (``export_weights``,
    ``save`` / ``load``)."""

    dp_rank, dp_size = 0, 1  # one replica: nothing to split or sum

    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        return torch.where(batch["response_mask"] > 0, self.forward(batch)[0], 0.0)

    def forward_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.score(self._on_device(batch))

    def forward_backward(self, micro_batches: Sequence[Batch], loss_fn: LossFn) -> list[dict[str, float]]:
        return forward_backward(lambda micro, entropy: self.forward(micro), micro_batches, loss_fn)

    def _params_with_grads(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def finish_gradients(self, max_norm: float) -> float:
        return clip_gradients(self._params_with_grads(), max_norm)

    def apply_gradients(self, lr: float) -> str | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return step_checked(self.optimizer, self._params_with_grads())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return values

    def local_rows(self, batch: Batch) -> Batch:
        return batch
