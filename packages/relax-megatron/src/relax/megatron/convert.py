"""HF transformers state dict <-> megatron-core GPTModel state dict, for any family whose model adapter declares
a megatron layout (``relax.core.model_family.MegatronLayout``); the model itself is built by
:mod:`relax.megatron.gpt_model`.

Pure functions over ``{name: tensor}`` dicts (megatron-bridge needs Transformer Engine and does not import
on CPU, so the mapping is written here). The Megatron side is the local (non-TE) layer spec:

* ``linear_qkv`` fuses q/k/v per query group: for each of the ``ng`` KV groups, its ``nh/ng`` query heads,
  then its key head, then its value head (rows of ``head_dim``). A TP shard is a contiguous run of groups.
* ``linear_fc1`` fuses gate and up; a TP shard is ``[gate_shard; up_shard]``.
* column-parallel weights (qkv, fc1, embedding, output layer) split along dim 0, row-parallel (proj,
  fc2) along dim 1; norms (incl. Qwen3's per-head q/k norms) are replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from relax.core.model_family import MegatronLayout, megatron_layout

Tensor = torch.Tensor
# state_dict entries megatron adds for Transformer Engine / fp8 metadata: never weights
EXTRA_STATE = "._extra_state"


@dataclass(frozen=True)
class Dims(MegatronLayout):
    """The shapes and choices the mapping needs, read once from an HF config through its family's model adapter
    (``relax.core.model_family.megatron_layout``: relax-megatron names no family)."""

    @classmethod
    def from_hf(cls, hf_config: Any) -> Dims:
        layout = megatron_layout(hf_config)
        return cls(**{f.name: getattr(layout, f.name) for f in fields(layout)})

    def padded_vocab(self, tp: int) -> int:
        """Rows of megatron's embedding / output layer: the vocabulary padded to a multiple of TP (as megatron
        pads it; the padding rows are zeros, their logits masked out by the trainer, dropped on export)."""
        return -(-self.vocab // tp) * tp

    def check_tp(self, tp: int) -> None:
        """Reject a TP size that does not divide every split dimension, naming which one."""
        for what, n in (("num_key_value_heads", self.groups), ("intermediate_size", self.ffn)):
            if tp < 1 or n % tp:
                raise ValueError(f"tensor_parallel={tp} must divide {what}={n}")


def _part(t: Tensor, tp: int, rank: int, dim: int) -> Tensor:
    """TP rank ``rank``'s part of ``t`` split along ``dim``, as a copy: ``t`` (read for this one use) is
    freed as soon as the caller drops it, and no other rank's part is ever allocated."""
    return torch.chunk(t, tp, dim=dim)[rank].clone()


def _vocab_part(t: Tensor, d: Dims, tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s rows of an embedding / LM head zero-padded to :meth:`Dims.padded_vocab`."""
    rows = d.padded_vocab(tp) // tp
    own = t[rank * rows : (rank + 1) * rows]
    pad = rows - own.shape[0]
    return torch.cat([own, own.new_zeros(pad, *t.shape[1:])]) if pad else own.clone()


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, d: Dims) -> Tensor:
    """HF q/k/v projections -> megatron ``linear_qkv`` rows, grouped per KV group; of every group, or of a
    contiguous run of groups (a TP rank's: its rows of each of q, k and v)."""
    per, cols = d.heads // d.groups, q.shape[-1]
    q = q.reshape(-1, per * d.head_dim, cols)
    k = k.reshape(-1, d.head_dim, cols)
    v = v.reshape(-1, d.head_dim, cols)
    return torch.cat([q, k, v], dim=1).reshape(-1, cols)


def split_qkv(qkv: Tensor, d: Dims) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv` (for a full, TP-gathered weight)."""
    per = d.heads // d.groups
    g = qkv.reshape(d.groups, (per + 2) * d.head_dim, -1)
    q, k, v = torch.split(g, [per * d.head_dim, d.head_dim, d.head_dim], dim=1)
    cols = qkv.shape[-1]
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def _attention_names(d: Dims) -> list[str]:
    if d.attention != "gqa":
        from relax.megatron import mla

        return mla.hf_names(d)
    names = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
    names += [f"self_attn.{x}_norm.weight" for x in "qk"] if d.qk_norm else []
    return names + ([f"self_attn.{x}_proj.bias" for x in "qkv"] if d.qkv_bias else [])


def hf_weight_names(hf_config: Any) -> list[str]:
    """Every HF weight name the mapping reads (and :func:`megatron_to_hf` writes) for this config."""
    from relax.megatron import moe

    d = Dims.from_hf(hf_config)
    dense = [f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")]
    names = ["model.embed_tokens.weight", "model.norm.weight"] + (["lm_head.weight"] if not d.tied else [])
    for i in range(d.num_layers):
        mlp = moe.hf_names(d) if moe.is_moe_layer(d, i) else dense
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", *_attention_names(d), *mlp]
        names += [f"model.layers.{i}.{w}" for w in per_layer]
    return names


def _mlp_to_megatron(hf: Mapping[str, Tensor], hp: str, mp: str, tp: int, rank: int) -> dict[str, Tensor]:
    """A gated MLP (HF prefix ``hp``: ``gate_proj`` / ``up_proj`` / ``down_proj``) -> TP rank ``rank``'s
    megatron ``mp`` ``linear_fc1`` (``[gate_shard; up_shard]``) / ``linear_fc2``."""
    gate, up = (_part(hf[hp + f"{w}_proj.weight"], tp, rank, 0) for w in ("gate", "up"))
    return {
        mp + "linear_fc1.weight": torch.cat([gate, up], 0),
        mp + "linear_fc2.weight": _part(hf[hp + "down_proj.weight"], tp, rank, 1),
    }


def _mlp_to_hf(shards: Sequence[Mapping[str, Tensor]], hp: str, mp: str) -> dict[str, Tensor]:
    halves = [torch.chunk(s[mp + "linear_fc1.weight"], 2, 0) for s in shards]
    return {
        hp + "gate_proj.weight": torch.cat([g for g, _ in halves], 0),
        hp + "up_proj.weight": torch.cat([u for _, u in halves], 0),
        hp + "down_proj.weight": torch.cat([s[mp + "linear_fc2.weight"] for s in shards], 1),
    }


def _checked(hf: Mapping[str, Tensor], hf_config: Any, tp: int, ep: int) -> Dims:
    from relax.megatron import moe

    d = Dims.from_hf(hf_config)
    d.check_tp(tp)
    if ep > 1 or d.experts:
        moe.check_ep(d, ep)
    missing = sorted(set(hf_weight_names(hf_config)) - set(hf))
    if missing:
        raise KeyError(
            f"the HF state dict lacks {len(missing)} {hf_config.model_type} weight(s): {missing[:8]}"
        )
    return d


def hf_to_megatron(
    hf: Mapping[str, Tensor], hf_config: Any, tp: int = 1, ep: int = 1
) -> list[dict[str, Tensor]]:
    """HF state dict -> one megatron GPTModel state dict per TP rank (``result[rank]``); for an
    MoE model one per (TP rank ``t``, expert-parallel rank ``e``) at ``result[t * ep + e]``: the TP
    shard of the attention and embeddings with EP rank ``e``'s ``experts / ep`` whole local experts (expert
    tensor parallelism 1: :mod:`relax.megatron.moe`)."""
    d = _checked(hf, hf_config, tp, ep)
    shards = [_tp_shard(hf, d, tp, t) for t in range(tp)]
    if not d.experts:
        return shards
    experts = [_ep_shard(hf, d, ep, e) for e in range(ep)]
    return [{**shard, **part} for shard in shards for part in experts]  # each TP shard with each EP rank's


def hf_to_megatron_rank(
    hf: Mapping[str, Tensor], hf_config: Any, tp: int = 1, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0
) -> dict[str, Tensor]:
    """``hf_to_megatron(hf, hf_config, tp, ep)[tp_rank * ep + ep_rank]`` with only that rank's tensors ever
    made: each HF tensor is cut to the rank's rows (or columns) before q/k/v or gate/up are fused, so a
    loading rank holds what it reads plus its own part of it (``rank_load``), never every rank's."""
    d = _checked(hf, hf_config, tp, ep)
    if not (0 <= tp_rank < tp and 0 <= ep_rank < ep):
        raise ValueError(
            f"rank (tp {tp_rank}, ep {ep_rank}) outside tensor_parallel={tp} x expert_parallel={ep}"
        )
    return {**_tp_shard(hf, d, tp, tp_rank), **(_ep_shard(hf, d, ep, ep_rank) if d.experts else {})}


def _tp_shard(hf: Mapping[str, Tensor], d: Dims, tp: int, rank: int) -> dict[str, Tensor]:
    """TP rank ``rank``'s weights but for the routed experts, in model order."""
    from relax.megatron import mla, moe

    out = {"embedding.word_embeddings.weight": _vocab_part(hf["model.embed_tokens.weight"], d, tp, rank)}
    for i in range(d.num_layers):
        h, m = _layer_names(i)
        attention = _gqa_to_megatron if d.attention == "gqa" else mla.to_megatron
        out.update(attention(hf, h, m, d, tp, rank))
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        if not moe.is_moe_layer(d, i):
            out.update(_mlp_to_megatron(hf, h + "mlp.", m + "mlp.", tp, rank))
        elif d.shared_ffn:
            out.update(_mlp_to_megatron(hf, h + "mlp.shared_experts.", m + "mlp.shared_experts.", tp, rank))
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not d.tied:
        out["output_layer.weight"] = _vocab_part(hf["lm_head.weight"], d, tp, rank)
    return out


def _ep_shard(hf: Mapping[str, Tensor], d: Dims, ep: int, rank: int) -> dict[str, Tensor]:
    """EP rank ``rank``'s routers and local experts of every MoE layer (the same on every TP rank)."""
    from relax.megatron import moe

    out: dict[str, Tensor] = {}
    for i in range(d.num_layers):
        if moe.is_moe_layer(d, i):
            out.update(moe.experts_to_megatron(hf, *_layer_names(i), d, ep, rank))
    return out


def _gqa_to_megatron(
    hf: Mapping[str, Tensor], h: str, m: str, d: Dims, tp: int, rank: int
) -> dict[str, Tensor]:
    """One layer's attention (HF prefix ``h``, megatron prefix ``m``), TP rank ``rank``'s: its KV groups' rows
    of q, k and v (a contiguous run of groups) fused, its columns of the output projection."""
    a, s = h + "self_attn.", m + "self_attention."
    out = {
        s + "linear_qkv.weight": fuse_qkv(*(_part(hf[a + f"{x}_proj.weight"], tp, rank, 0) for x in "qkv"), d)
    }
    if d.qkv_bias:  # the bias rows follow the weight rows' grouping
        biases = (_part(hf[a + f"{x}_proj.bias"], tp, rank, 0)[:, None] for x in "qkv")
        out[s + "linear_qkv.bias"] = fuse_qkv(*biases, d)[:, 0]
    out[s + "linear_proj.weight"] = _part(hf[a + "o_proj.weight"], tp, rank, 1)
    if d.qk_norm:
        out[s + "q_layernorm.weight"] = hf[a + "q_norm.weight"].clone()
        out[s + "k_layernorm.weight"] = hf[a + "k_norm.weight"].clone()
    return out


def _gqa_to_hf(cat: Any, one: Any, h: str, m: str, d: Dims) -> dict[str, Tensor]:
    hf: dict[str, Tensor] = {}
    q, k, v = split_qkv(cat(m + "self_attention.linear_qkv.weight", 0), d)
    (
        hf[h + "self_attn.q_proj.weight"],
        hf[h + "self_attn.k_proj.weight"],
        hf[h + "self_attn.v_proj.weight"],
    ) = q, k, v
    if d.qkv_bias:
        biases = split_qkv(cat(m + "self_attention.linear_qkv.bias", 0)[:, None], d)
        for x, b in zip("qkv", biases, strict=True):
            hf[h + f"self_attn.{x}_proj.bias"] = b[:, 0].contiguous()
    hf[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
    if d.qk_norm:
        hf[h + "self_attn.q_norm.weight"] = one(m + "self_attention.q_layernorm.weight")
        hf[h + "self_attn.k_norm.weight"] = one(m + "self_attention.k_layernorm.weight")
    return hf


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    hf_config: Any,
    partial: bool = False,
    expert_shards: Sequence[Mapping[str, Tensor]] | None = None,
) -> dict[str, Tensor]:
    """Megatron state dicts of every TP rank (in rank order) -> the HF state dict. MoE: the
    experts from ``expert_shards`` (every EP rank's, in rank order); without them ``shards`` are the EP
    ranks' of a TP=1 model (its non-expert weights whole on each).

    Tied embeddings give no ``lm_head.weight`` (as ``save_pretrained`` writes them). ``partial``: the
    shards hold some units only (e.g. one layer, see :func:`export_units`); convert those.
    """
    from relax.megatron import moe

    d = Dims.from_hf(hf_config)
    if d.experts and expert_shards is None:
        shards, expert_shards = shards[:1], shards
    tp = len(shards)
    d.check_tp(tp)

    def cat(name: str, dim: int) -> Tensor:
        return torch.cat([s[name] for s in shards[:tp]], dim=dim)

    def one(name: str) -> Tensor:
        return shards[0][name].clone()

    def has(name: str) -> bool:
        return not partial or name in shards[0]

    hf: dict[str, Tensor] = {}
    if has("embedding.word_embeddings.weight"):
        hf["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[: d.vocab]
    for i in range(d.num_layers):
        h, m = _layer_names(i)
        if not has(m + "input_layernorm.weight"):
            continue
        if d.attention != "gqa":
            from relax.megatron import mla

            hf.update(mla.to_hf(cat, one, h, m, d))
        else:
            hf.update(_gqa_to_hf(cat, one, h, m, d))
        hf[h + "input_layernorm.weight"] = one(m + "input_layernorm.weight")
        hf[h + "post_attention_layernorm.weight"] = one(m + "pre_mlp_layernorm.weight")
        if moe.is_moe_layer(d, i):
            hf[h + "mlp.gate.weight"] = one(m + "mlp.router.weight")
            if d.expert_bias:
                hf[h + "mlp.gate.e_score_correction_bias"] = one(m + "mlp.router.expert_bias")
            hf.update(moe.experts_to_hf(expert_shards, h, m, d))
            if d.shared_ffn:
                hf.update(_mlp_to_hf(shards[:tp], h + "mlp.shared_experts.", m + "mlp.shared_experts."))
            continue
        hf.update(_mlp_to_hf(shards[:tp], h + "mlp.", m + "mlp."))
    if has("decoder.final_layernorm.weight"):
        hf["model.norm.weight"] = one("decoder.final_layernorm.weight")
    if not d.tied and has("output_layer.weight"):
        hf["lm_head.weight"] = cat("output_layer.weight", 0)[: d.vocab]
    return hf


def export_units(names: Sequence[str]) -> list[list[str]]:
    """Megatron weight names grouped into what :func:`megatron_to_hf` can convert on its own (one
    decoder layer, or one top-level weight), in model order: an export gathers and converts one unit
    at a time, never the whole model."""
    units: list[list[str]] = []
    key = None
    for name in names:
        i = _layer_index(name)
        this = ("layer", i) if i is not None else ("top", name)
        if this != key:
            units.append([])
            key = this
        units[-1].append(name)
    return units


def read_hf_checkpoint(model_dir: str) -> dict[str, Tensor]:
    """Every tensor of an HF directory's ``*.safetensors`` files, by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: the megatron trainer loads HF safetensors")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global decoder-layer indices of pipeline stage ``pp_rank`` (megatron's even split)."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"pipeline_parallel={pp} must divide num_hidden_layers={num_layers}")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def to_stage(shard: Mapping[str, Tensor], hf_config: Any, pp: int, pp_rank: int) -> dict[str, Tensor]:
    """One TP shard of the whole model -> the part pipeline stage ``pp_rank`` holds, with stage-local
    layer numbers. With tied embeddings the last stage holds its own ``output_layer.weight`` copy
    (megatron keeps the two in sync through the embedding group)."""
    d = Dims.from_hf(hf_config)
    layers = stage_layers(d.num_layers, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, Tensor] = {}
    for name, t in shard.items():
        i = _layer_index(name)
        if i is not None:
            if i in layers:
                out[f"decoder.layers.{i - layers.start}." + name.split(".", 3)[3]] = t
        elif (name.startswith("embedding.") and first) or (not name.startswith("embedding.") and last):
            out[name] = t
    if d.tied and last and pp > 1:
        out["output_layer.weight"] = shard["embedding.word_embeddings.weight"].clone()
    return out


def from_stages(stages: Sequence[Mapping[str, Tensor]], hf_config: Any) -> dict[str, Tensor]:
    """Inverse of :func:`to_stage` over every stage (in stage order) of one TP shard."""
    d = Dims.from_hf(hf_config)
    pp = len(stages)
    out: dict[str, Tensor] = {}
    for rank, stage in enumerate(stages):
        offset = stage_layers(d.num_layers, pp, rank).start
        for name, t in stage.items():
            i = _layer_index(name)
            if i is not None:
                out[f"decoder.layers.{i + offset}." + name.split(".", 3)[3]] = t
            elif not (d.tied and name == "output_layer.weight"):
                out[name] = t
    return out


def weights_only(state_dict: Mapping[str, Any]) -> dict[str, Tensor]:
    """A megatron module's ``state_dict()`` without the ``_extra_state`` entries (TE/fp8 metadata)."""
    return {n: t for n, t in state_dict.items() if not n.endswith(EXTRA_STATE)}


def load_hf_into(
    model: Any,
    hf: Mapping[str, Tensor],
    hf_config: Any,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
) -> None:
    """Copy HF weights into ``model`` (this TP / EP rank's shard of this pipeline stage); every model
    weight must be covered."""
    from relax.megatron.layer_specs import to_te_names, uses_te_names

    shard = to_stage(hf_to_megatron_rank(hf, hf_config, tp, tp_rank, ep, ep_rank), hf_config, pp, pp_rank)
    expected = set(weights_only(model.state_dict()))
    if uses_te_names(expected):  # the Transformer Engine spec: norms fused into the next linear layer
        shard = to_te_names(shard, moe=bool(Dims.from_hf(hf_config).experts))
    missing, unexpected = expected - set(shard), set(shard) - expected
    if missing or unexpected:
        raise ValueError(
            f"HF->megatron mapping mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if name in shard:
                param.copy_(shard[name])
