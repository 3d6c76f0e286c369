"""The gradient sums and clipping megatron's ``finalize_model_grads`` would do, for the trainer's own
(non-DDP) path: ``grad_params`` are ``(name, parameter)`` pairs, the model's or their fp32 masters."""

from __future__ import annotations

import torch

from relax.megatron.parallel import all_reduce_grads

NamedParams = list[tuple[str, torch.nn.Parameter]]


def is_expert(name: str) -> bool:
    """An MoE expert's weight (whole on each rank that holds it: expert tensor parallelism 1)."""
    return ".mlp.experts." in name


def sum_tensor_parallel_replica_grads(grad_params: NamedParams, tp: int, tp_group) -> None:
    """Weights replicated over TP whose copies each see part of the work: Qwen3's q/k norms (each rank
    applies them to its own heads) and, with sequence parallelism, the norms and MoE routers (marked
    ``sequence_parallel``: each rank's slice of the sequence). Their gradient is the sum over the TP
    ranks: what megatron's ``finalize_model_grads`` does (``_allreduce_non_tensor_model_parallel_grads``)."""
    if tp == 1:
        return

    def split_work(name: str, param: torch.nn.Parameter) -> bool:
        return getattr(param, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name

    all_reduce_grads([p for n, p in grad_params if p.requires_grad and split_work(n, p)], tp_group)


def sum_tied_embedding_grads(model: torch.nn.Module, masters) -> None:
    """PP with tied embeddings: the first stage's embedding and the last stage's output layer are one
    weight; each gets the sum of both gradients (megatron's ``_allreduce_word_embedding_grads``)."""
    from megatron.core import parallel_state

    if not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if masters is not None:
        weight = masters.master_of(weight)
    if weight.grad is None:  # a stage whose rows reached no token: it still joins the sum
        weight.grad = torch.zeros_like(weight)
    torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def sum_data_parallel_grads(grad_params: NamedParams, dp: int, dp_group) -> None:
    """Each replica back-propagated its own rows: sum the gradients over the data-parallel ranks; expert
    weights over the expert-data-parallel ranks (megatron's groups: with EP the dispatcher already brought
    every EP rank's tokens to an expert; with sequence parallelism at EP = 1 each TP rank's experts saw
    that rank's tokens only, and the TP ranks are in the group)."""
    from megatron.core import parallel_state

    named = [(n, p) for n, p in grad_params if p.requires_grad]
    if dp > 1:
        all_reduce_grads([p for n, p in named if not is_expert(n)], dp_group)
    experts = [p for n, p in named if is_expert(n)]
    if experts and parallel_state.get_expert_data_parallel_world_size() > 1:
        all_reduce_grads(experts, parallel_state.get_expert_data_parallel_group())


def clip_grad_norm(grad_params: NamedParams, max_norm: float, device: torch.device, *, simple: bool) -> float:
    """Clip to the norm of the whole model's gradient; TP shards, pipeline stages and EP ranks'
    experts count once, replicated weights (norms, a tied embedding's copy) once, not once per rank.
    ``simple`` (TP = PP = EP = 1): torch's ``clip_grad_norm_``."""
    named = [(n, p) for n, p in grad_params if p.grad is not None]
    params = [p for _, p in named]
    if simple:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    def square(grads: list[torch.Tensor], group) -> torch.Tensor:
        total = (
            torch.stack([g.float().square().sum() for g in grads]).sum()
            if grads
            else torch.zeros((), device=device)
        )
        torch.distributed.all_reduce(total, group=group)
        return total

    owned = [(n, p) for n, p in named if param_is_not_shared(p)]
    dense = [p.grad for n, p in owned if not is_expert(n) and param_is_not_tensor_parallel_duplicate(p)]
    total = square(dense, parallel_state.get_model_parallel_group())
    experts = [p.grad for n, p in owned if is_expert(n)]  # each expert once per EP x PP group (ETP = 1)
    if experts:
        total = total + square(experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return norm
