"""Megatron context parallelism (CP): one long sequence split over ``context_parallel`` ranks.

Layout: megatron's rank order ``tp-cp-ep-dp-pp``, so world = TP x CP x PP x DP; the CP ranks of one
replica hold the same rows and the same weights, each a part of every row's tokens.

Load balance: under causal attention a late token attends to more keys than an early one, so the padded
sequence is cut into ``2 x CP`` chunks and CP rank ``i`` holds chunks ``i`` and ``2 CP - 1 - i`` (every rank
then has one early and one late chunk). That is the order megatron's rotary embedding takes its positions
in (``get_pos_emb_on_this_cp_rank``) and Transformer Engine's ring attention (``cp_comm_type: p2p``)
expects; :func:`local_part` and :func:`reassemble` are the split and its inverse.

Scoring (:func:`cp_response_scores`): each rank scores the response tokens that its own positions predict
(vocab-parallel over TP as without CP), the per-token scores are all-gathered over the CP group and put
back in sequence order, so every CP rank holds the replica's whole ``(B, R)`` logprobs and computes the same
loss. The gather's backward keeps this rank's slice of that (identical) gradient, so each rank's parameter
gradients are its tokens' share of the replica's; summed over DP x CP (megatron's
``get_data_parallel_group(with_context_parallel=True)``, which its DDP and distributed optimizer reduce
over) they are the data-parallel sum. Token counts and metric sums stay summed over DP only (each
replica once), so the loss normalisation by the step-global token count is unchanged.

Status: the attention under CP exists only in Transformer Engine (megatron's local ``DotProductAttention``
asserts ``context_parallel_size == 1``), so the model itself has not run under CP in this repo: the split,
the gather, the scores and the gradient sums are tested on CPU (``tests/test_context_parallel.py``, gloo
world 2 with a per-token model), the whole trainer at CP = 2 against CP = 1 only by
``tests/test_gpu_cp.py`` on two GPUs with Transformer Engine (``scripts/gpu_check.sh``), not yet run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relax.megatron.padding import left_pads

Tensor = torch.Tensor

#: why context parallelism needs Transformer Engine (plugin validation and the trainer's start-up)
TE_REASON = (
    "context_parallel > 1 runs in Transformer Engine's attention (megatron's local attention asserts "
    "context_parallel_size == 1): set device: cuda and layer_spec: te, with Transformer Engine built for "
    "your torch (docs/gpu.md#transformer-engine); or context_parallel: 1"
)


def sequence_multiple(tensor_parallel: int, sequence_parallel: bool, context_parallel: int) -> int:
    """What a stage pads the sequence to: ``2 x CP`` chunks, each split over the TP ranks under sequence
    parallelism (1 without either)."""
    cp = 2 * context_parallel if context_parallel > 1 else 1
    return cp * (tensor_parallel if sequence_parallel else 1)


def rank_columns(length: int, cp: int, rank: int, device: Any = None) -> Tensor:
    """The columns of a ``length``-long sequence (a multiple of ``2 cp``) that CP rank ``rank`` holds, in
    its order: chunk ``rank`` then chunk ``2 cp - 1 - rank``. Also its tokens' position ids."""
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not a multiple of 2 x context_parallel = {2 * cp}")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


def local_part(t: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """CP rank ``rank``'s two chunks of ``t`` along ``dim`` (its length a multiple of ``2 cp``); ``t`` at CP 1."""
    if cp == 1:
        return t
    return t.index_select(dim, rank_columns(t.shape[dim], cp, rank, t.device))


def reassemble(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`local_part`: every CP rank's part (rank order) -> the whole sequence along ``dim``."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    joined = torch.cat(parts, dim)
    order = torch.cat([rank_columns(joined.shape[dim], cp, r) for r in range(cp)])
    return joined.index_select(dim, torch.argsort(order).to(joined.device))


class _GatherOverCP(torch.autograd.Function):
    """Forward: every CP rank's part, reassembled (the same on every rank). Backward: this rank's slice of
    the gradient; every CP rank computes the same loss from the same gathered values, so that slice is
    the whole gradient of its part (a sum over the ranks would count it CP times)."""

    @staticmethod
    def forward(ctx, local: Tensor, cp: int, rank: int, group: Any, dim: int) -> Tensor:
        ctx.cp, ctx.rank, ctx.dim = cp, rank, dim
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return reassemble(parts, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return local_part(grad, ctx.cp, ctx.rank, ctx.dim), None, None, None, None


def gather_over_cp(local: Tensor, cp: int, rank: int, group: Any, dim: int = 1) -> Tensor:
    """The whole sequence from every CP rank's :func:`local_part` along ``dim``, differentiable (see
    :class:`_GatherOverCP`); ``local`` itself at CP 1."""
    return local if cp == 1 else _GatherOverCP.apply(local, cp, rank, group, dim)


def response_columns(batch: dict[str, Tensor]) -> Tensor:
    """(B, R) column of each response-predicting position in the right-padded layout
    (:func:`relax.megatron.padding.right_padded`): ``P - 1 - left pads + j`` for response token ``j``."""
    responses = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - responses
    shift = left_pads(batch["attention_mask"]).to(batch["responses"].device)
    start = (prompt_len - 1 - shift).clamp(min=0)
    return torch.arange(responses, device=start.device)[None] + start[:, None]


def response_targets(responses: Tensor, columns: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """((B, length) target ids, (B, length) bool: the position predicts a response token), from the (B, R)
    ``responses`` and their :func:`response_columns`."""
    rows = responses.shape[0]
    targets = responses.new_zeros(rows, length).scatter(1, columns, responses)
    predicts = torch.zeros(rows, length, dtype=torch.bool, device=responses.device)
    return targets, predicts.scatter(1, columns, True)


def cp_response_scores(
    batch: dict[str, Tensor],
    out: Tensor,
    token_scores: Callable[[Tensor, Tensor], tuple[Tensor, ...]],
    cp: int,
    rank: int,
    group: Any,
) -> tuple[Tensor, ...]:
    """Each of ``token_scores``' outputs for the batch's response tokens, (B, R), from this CP rank's
    last-stage ``out`` (B, T / CP, X): its chunks' logits, or hidden states that ``token_scores`` multiplies
    by the output weight. ``token_scores(x (1, N, X), targets (1, N))`` scores N tokens. Collective over
    the CP group; differentiable (each rank's gradient reaches its own positions only)."""
    columns = response_columns(batch).to(out.device)
    length = out.shape[1] * cp
    targets, predicts = response_targets(batch["responses"].to(out.device), columns, length)
    mine = local_part(predicts, cp, rank)
    rows, cols = mine.nonzero(as_tuple=True)
    empty = rows.numel() == 0
    if empty:  # no response token here: score one position anyway, so backward still runs this rank's model
        rows = cols = torch.zeros(1, dtype=torch.long, device=out.device)
    scores = token_scores(out[rows, cols][None], local_part(targets, cp, rank)[rows, cols][None])
    local = []
    for s in scores:
        values = s[0].float()
        placed = values.new_zeros(mine.shape)
        placed = placed + 0.0 * values.sum() if empty else placed.index_put((rows, cols), values)
        local.append(placed)
    whole = gather_over_cp(torch.stack(local), cp, rank, group, dim=2)  # (k, B, T)
    picked = whole.gather(2, columns[None].expand(whole.shape[0], -1, -1))
    return tuple(picked.unbind(0))


def cp_run_problems(context_parallel: int, cfg: Any) -> list[str]:
    """What a run at ``context_parallel`` > 1 asks that the CP path does not do (``relax validate``): packed
    rows (megatron's THD layout), media rows (a rank's chunks would cut their placeholders; M-RoPE) and MoE
    routing replay (routes recorded per padded position, not split)."""
    if context_parallel <= 1:
        return []
    problems = []
    if cfg.trainer.pack_sequences:
        problems.append(
            "trainer.pack_sequences with trainer.backend_params.context_parallel > 1: megatron's context "
            "parallelism here splits padded rows, not packed (THD) sequences; set pack_sequences: false"
        )
    if getattr(cfg.algorithm, "routing_replay", "off") != "off":
        problems.append(
            "algorithm.routing_replay with trainer.backend_params.context_parallel > 1: the recorded routes "
            "are per padded position and are not split over the CP ranks; set context_parallel: 1"
        )
    if _is_media_model(cfg.model.path):
        problems.append(
            "trainer.backend_params.context_parallel > 1 with a media model: a rank's chunks would cut the "
            "media placeholders and their M-RoPE positions; megatron's CP here takes text models only"
        )
    return problems


def _is_media_model(model_path: str | None) -> bool:
    from pathlib import Path

    if not model_path or not (Path(model_path) / "config.json").is_file():
        return False
    from relax.core.multimodal_model import adapter_for, model_config

    return adapter_for(model_config(model_path).model_type) is not None
