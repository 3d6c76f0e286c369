"""Qwen3-MoE on megatron-core: the expert/router part of the HF <-> megatron mapping and the MoE
settings of the model config (the attention and norms map as for dense Qwen3 in :mod:`convert`).

* HF ``mlp.gate`` (the router, ``[experts, hidden]``) is megatron's ``mlp.router``.
* HF expert ``j``'s ``gate_proj`` / ``up_proj`` fuse into ``mlp.experts.local_experts.<k>.linear_fc1``
  (``[gate; up]``), ``down_proj`` is ``linear_fc2``. Expert parallelism: EP rank ``r`` holds experts
  ``r * E/ep ... (r+1) * E/ep - 1`` as local experts ``0 ... E/ep - 1``; everything else is replicated
  (TP-sharded as in a dense model at TP > 1).
* Tensor parallelism: expert tensor parallelism 1 (megatron's ``expert_tensor_parallel_size``): each TP
  rank holds its experts whole, so the mapping of the experts does not depend on TP. Megatron's MoE layer
  needs sequence parallelism at TP > 1 (``moe_layer.py``); each TP rank then routes its own slice of the
  sequence. At EP = 1 its experts see those tokens only, so their gradients are summed over the
  expert-data-parallel group, which holds the TP ranks; with EP > 1 (carved from TP x DP) the allgather
  dispatcher brings the tokens of the whole TP x EP group to each expert. ETP = TP would shard the experts'
  fc1 / fc2 across TP as well, for nothing at these expert sizes but extra mapping and gathers.
* Routing: Qwen3-MoE takes a softmax over all experts, then the top k, renormalised when
  ``norm_topk_prob``. Megatron's top-k then softmax equals the renormalised form; with
  ``moe_router_pre_softmax`` (softmax first) the plain one. No load-balancing loss at train time here
  (``moe_aux_loss_coeff = 0``); the allgather dispatcher (the alltoall one needs CUDA streams).
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


def experts_to_megatron(hf: Mapping[str, Tensor], h: str, m: str, d: Any, ep: int) -> list[dict[str, Tensor]]:
    """One layer's router and experts (HF prefix ``h``, megatron prefix ``m``) per EP rank."""
    per = d.experts // ep
    out: list[dict[str, Tensor]] = []
    for rank in range(ep):
        part = {m + "mlp.router.weight": hf[h + "mlp.gate.weight"].clone()}
        for k in range(per):
            e = f"{h}mlp.experts.{rank * per + k}."
            local = f"{m}mlp.experts.local_experts.{k}."
            part[local + "linear_fc1.weight"] = torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]], 0)
            part[local + "linear_fc2.weight"] = hf[e + "down_proj.weight"]
        out.append(part)
    return out


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
    return {
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
