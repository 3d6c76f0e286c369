"""MoE layers on megatron-core: the expert / router / shared-expert part of the HF <-> megatron mapping and the
MoE settings of the model config (the attention and norms map as in :mod:`convert`). What a family's MoE is
(router kind, shared experts, dense first layers) its model adapter declares (``MegatronLayout``).

* HF ``mlp.gate`` (the router, ``[experts, hidden]``) is megatron's ``mlp.router``; a sigmoid router's
  selection bias (HF ``mlp.gate.e_score_correction_bias``) is megatron's ``mlp.router.expert_bias``, kept as
  loaded (``moe_router_bias_update_rate`` 0: RL fine-tuning does not rebalance the experts).
* HF expert ``j``'s ``gate_proj`` / ``up_proj`` fuse into ``mlp.experts.local_experts.<k>.linear_fc1``
  (``[gate; up]``), ``down_proj`` is ``linear_fc2``. Expert parallelism: EP rank ``r`` holds experts
  ``r * E/ep ... (r+1) * E/ep - 1`` as local experts ``0 ... E/ep - 1``; everything else is replicated
  (TP-sharded as in a dense model at TP > 1).
* Shared experts (HF ``mlp.shared_experts``, one MLP of ``n_shared * moe_intermediate`` rows) are megatron's
  ``mlp.shared_experts`` (TP-sharded like a dense MLP, on every EP rank). The first ``dense_layers`` layers
  keep a dense MLP (``moe_layer_freq``).
* Tensor parallelism: expert tensor parallelism 1 (megatron's ``expert_tensor_parallel_size``): each TP
  rank holds its experts whole, so the mapping of the experts does not depend on TP. Megatron's MoE layer
  needs sequence parallelism at TP > 1 (``moe_layer.py``); each TP rank then routes its own slice of the
  sequence. At EP = 1 its experts see those tokens only, so their gradients are summed over the
  expert-data-parallel group, which holds the TP ranks; with EP > 1 (carved from TP x DP) the allgather
  dispatcher brings the tokens of the whole TP x EP group to each expert.
* Routing: softmax over all experts then the top k (renormalised when ``norm_topk``: megatron's top-k then
  softmax; else ``moe_router_pre_softmax``), or a sigmoid per expert, the top k picked on score + bias,
  weighted by the scores renormalised (megatron always renormalises a sigmoid top k > 1) and scaled by
  ``topk_scaling``. No load-balancing loss at train time here (``moe_aux_loss_coeff = 0``); the allgather
  dispatcher (the alltoall one needs CUDA streams).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

Tensor = torch.Tensor


def check_ep(d: Any, ep: int) -> None:
    if not d.experts:
        raise ValueError(f"expert_parallel={ep} needs an MoE model (this one is dense)")
    if ep < 1 or d.experts % ep:
        raise ValueError(f"expert_parallel={ep} must divide num_experts={d.experts}")


def is_moe_layer(d: Any, layer: int) -> bool:
    """Whether decoder layer ``layer`` (global index) has MoE experts (the first ``dense_layers`` do not)."""
    return bool(d.experts) and layer >= d.dense_layers


def hf_names(d: Any) -> list[str]:
    """An MoE layer's HF weight names under ``mlp.`` (router, its bias, experts, shared experts)."""
    names = ["mlp.gate.weight"] + (["mlp.gate.e_score_correction_bias"] if d.expert_bias else [])
    names += [
        f"mlp.experts.{j}.{w}.weight" for j in range(d.experts) for w in ("gate_proj", "up_proj", "down_proj")
    ]
    return names + (
        [f"mlp.shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")]
        if d.shared_ffn
        else []
    )


def experts_to_megatron(
    hf: Mapping[str, Tensor], h: str, m: str, d: Any, ep: int, rank: int
) -> dict[str, Tensor]:
    """One layer's router and EP rank ``rank``'s local experts (HF prefix ``h``, megatron prefix ``m``); the
    other ranks' experts are not touched (a loading rank reads its own only: ``rank_load``)."""
    per = d.experts // ep
    part = {m + "mlp.router.weight": hf[h + "mlp.gate.weight"].clone()}
    if d.expert_bias:  # megatron keeps it in float32
        part[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"].float().clone()
    for k in range(per):
        e = f"{h}mlp.experts.{rank * per + k}."
        local = f"{m}mlp.experts.local_experts.{k}."
        part[local + "linear_fc1.weight"] = torch.cat(
            [hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]], 0
        )
        part[local + "linear_fc2.weight"] = hf[e + "down_proj.weight"]
    return part


def experts_to_hf(shards: Sequence[Mapping[str, Tensor]], h: str, m: str, d: Any) -> dict[str, Tensor]:
    """Inverse of :func:`experts_to_megatron` over every EP rank's shard (in rank order), but for the
    router (replicated: the caller takes it from any rank)."""
    per = d.experts // len(shards)
    hf: dict[str, Tensor] = {}
    for rank, shard in enumerate(shards):
        for k in range(per):
            e = f"{h}mlp.experts.{rank * per + k}."
            local = f"{m}mlp.experts.local_experts.{k}."
            gate, up = torch.chunk(shard[local + "linear_fc1.weight"], 2, 0)
            hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"] = gate.clone(), up.clone()
            hf[e + "down_proj.weight"] = shard[local + "linear_fc2.weight"]
    return hf


def moe_config(d: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields of an MoE model (empty for a dense one)."""
    if not d.experts:
        return {}
    config = {
        "num_moe_experts": d.experts,
        "moe_router_topk": d.topk,
        "moe_ffn_hidden_size": d.moe_ffn,
        "moe_router_pre_softmax": not d.norm_topk,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "expert_tensor_parallel_size": 1,
    }
    if d.dense_layers:
        config["moe_layer_freq"] = [0] * d.dense_layers + [1] * (d.num_layers - d.dense_layers)
    if d.shared_ffn:
        config["moe_shared_expert_intermediate_size"] = d.shared_ffn
    if d.topk_scaling != 1.0:
        config["moe_router_topk_scaling_factor"] = d.topk_scaling
    if d.router == "sigmoid":
        if not d.norm_topk and d.topk > 1:
            raise ValueError(
                "a sigmoid router without norm_topk_prob is not supported by the megatron mapping "
                "(megatron-core renormalises a sigmoid router's top k)"
            )
        config.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False)
        if d.expert_bias:
            config.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if d.router_groups > 1:
        if d.topk % d.router_topk_groups or d.topk // d.router_topk_groups != 2:
            raise ValueError(
                f"group-limited routing with top {d.topk} over {d.router_topk_groups} groups: megatron-core "
                "scores a group by its top (topk / groups) experts, the HF model by its top 2"
            )
        config.update(moe_router_num_groups=d.router_groups, moe_router_group_topk=d.router_topk_groups)
    return config
