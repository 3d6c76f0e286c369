"""fp32 master weights for a bf16 megatron model trained without megatron's DistributedOptimizer.

AdamW stepping bf16 parameters directly rounds every update of size ``lr * g / sqrt(v)`` below half a
bf16 ulp of the weight away: at RL learning rates (1e-6) almost no weight ever moves. Megatron's own
answer (``Float16OptimizerWithFloat16Params``) keeps an fp32 copy of every parameter, accumulates
gradients in fp32 and copies the updated fp32 weights back into the bf16 model; that class checks for
``torch.cuda.*Tensor`` parameters, so it cannot run (or be tested) on CPU. :class:`MasterWeights` is
the same scheme on plain torch: the optimizer steps the fp32 masters, whose ``.grad`` each bf16
parameter's gradient is added to (in fp32) as soon as autograd has accumulated it, so micro-batch
accumulation, the data-parallel all-reduce and clipping all see fp32 gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

#: megatron's tensor-parallel attributes, read by its grad-norm helpers (``param_is_not_tensor_parallel_duplicate``,
#: ``param_is_not_shared``): the masters carry their parameter's
_PARALLEL_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "allreduce",
    "sequence_parallel",
)
#: the optimizer-state key under which a checkpoint stores a master (see :mod:`relax.megatron.checkpoint`)
MASTER_KEY = "fp32_param"


class MasterWeights:
    """fp32 masters of ``named`` (name, parameter) pairs: what the optimizer steps and the gradient code
    reduces, by the same names as the model's parameters. An fp32 parameter is its own master."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []  # the model's, in the masters' order
        self.masters: list[torch.nn.Parameter] = []
        self._hooks = []  # the handles of the gradient hooks (kept with the masters they write to)
        for name, param in named:
            self.names.append(name)
            self.params.append(param)
            if param.dtype == torch.float32:  # already fp32 (megatron's torch norms): its own master
                self.masters.append(param)
                continue
            master = torch.nn.Parameter(param.detach().float().clone())
            for attr in _PARALLEL_ATTRS:
                if hasattr(param, attr):
                    setattr(master, attr, getattr(param, attr))
            self.masters.append(master)
            self._hooks.append(param.register_post_accumulate_grad_hook(_accumulate_into(master)))

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(model parameter name, fp32 master): the masters hold the gradients (``.grad``, fp32)."""
        return list(zip(self.names, self.masters, strict=True))

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        return self.masters[next(i for i, p in enumerate(self.params) if p is param)]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The updated masters into the bf16 model (round to nearest), after each optimizer step or load."""
        for param, master in zip(self.params, self.masters, strict=True):
            if param is not master:
                param.copy_(master)


def _accumulate_into(master: torch.nn.Parameter):
    """A post-accumulate-grad hook: add the bf16 gradient to ``master.grad`` in fp32 and free it."""

    def hook(param: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return hook


def master_state(optimizer: torch.optim.Optimizer, masters: MasterWeights) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each master stored next to its Adam moments (``MASTER_KEY``):
    a resumed bf16 run continues from the fp32 weights, not from their bf16 rounding. A new dict (the
    live optimizer state is not touched)."""
    optim = optimizer.state_dict()
    optim["state"] = {i: {**s, MASTER_KEY: masters.masters[i]} for i, s in optim["state"].items()}
    return optim


def restore_masters(optim: dict[str, Any], masters: MasterWeights) -> dict[str, Any]:
    """Inverse of :func:`master_state`: copy the stored masters back (then into the model) and return
    the optimizer state without them."""
    with torch.no_grad():
        for i, state in optim["state"].items():
            masters.masters[i].copy_(state.pop(MASTER_KEY))
    masters.copy_to_model()
    return optim
