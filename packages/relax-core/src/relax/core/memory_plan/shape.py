"""A model's shape from its ``config.json`` alone (no weights): the numbers the memory plan multiplies.

Read generically, so core names no model family: the language model is the (sub-)config with a vocabulary
and the most parameters; its sibling sub-configs without a vocabulary (vision / audio encoders of a media
model) are its towers, counted as extra parameters; everything further out (e.g. a speech generator next to
the model that is trained) is not part of the trained model and is left out.

Parameter counts are exact for decoder-only transformers with SwiGLU MLPs (attention projections, q/k
norms, MoE experts and router, shared experts, embeddings, tied or not) up to biases; towers are estimated
as plain pre-norm encoders (4 H^2 attention + 2 H I MLP per block): within a few percent, and towers are
a small share of every model the recipes train.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "depth", "encoder_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "embed_dim")
_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "n_inner")


def _first(d: dict[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    return next(
        (d[k] for k in keys if isinstance(d.get(k), int | float) and not isinstance(d.get(k), bool)), default
    )


@dataclass(frozen=True)
class ModelShape:
    """The trained language model: sizes of one decoder layer, the vocabulary, and its towers' parameters."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 when every layer is MoE)
    vocab: int
    tied_embeddings: bool = True
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    moe_layers: int = 0  # how many of ``layers`` are MoE layers
    tower_params: int = 0  # media encoders (vision, audio) trained with it

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + 2 * self.head_dim

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def expert_params_per_layer(self) -> int:
        """The routed experts of one MoE layer (what expert parallelism splits)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    def layer_params(self, moe: bool) -> int:
        """One decoder layer with its two norms; ``moe``: router, routed and shared experts instead of the MLP."""
        mlp = (
            (
                self.expert_params_per_layer()
                + self.hidden * self.experts
                + 3 * self.hidden * self.shared_expert_intermediate
            )
            if moe
            else self.dense_mlp_params()
        )
        return self.attention_params() + mlp + 2 * self.hidden

    def embedding_params(self) -> int:
        """Input embedding, output head (unless tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def expert_params(self) -> int:
        return self.moe_layers * self.expert_params_per_layer()

    def total_params(self) -> int:
        dense_layers = self.layers - self.moe_layers
        return (
            dense_layers * self.layer_params(False)
            + self.moe_layers * self.layer_params(True)
            + self.embedding_params()
            + self.tower_params
        )

    def largest_layer_params(self) -> int:
        return self.layer_params(self.moe_layers > 0)


class ShapeError(ValueError):
    """A config.json the plan cannot read a language model from."""


Tree = dict[str, Any]


def _subconfigs(d: Tree, parent: Tree | None = None) -> Iterator[tuple[Tree, Tree | None]]:
    """Every dict of the config tree with the dict that holds it."""
    yield d, parent
    for value in d.values():
        if isinstance(value, dict):
            yield from _subconfigs(value, d)


def _is_lm(d: dict[str, Any]) -> bool:
    return isinstance(d.get("vocab_size"), int) and _first(d, _LAYERS) and _first(d, _HIDDEN) is not None


def _lm_shape(d: dict[str, Any], tied_default: bool) -> ModelShape:
    hidden = int(_first(d, _HIDDEN))
    layers = int(_first(d, _LAYERS))
    heads = int(_first(d, ("num_attention_heads", "n_head", "num_heads"), 1))
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or hidden // heads)
    experts = int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0)
    moe_layers = 0
    if experts:
        step = int(d.get("decoder_sparse_step") or 1)
        dense_only = set(d.get("mlp_only_layers") or [])
        first_dense = int(d.get("first_k_dense_replace") or 0)
        moe_layers = sum(
            1 for i in range(layers) if i not in dense_only and i >= first_dense and (i + 1) % step == 0
        )
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    if not shared and d.get("n_shared_experts"):
        shared = int(d["n_shared_experts"]) * int(d.get("moe_intermediate_size") or 0)
    tied = d.get("tie_word_embeddings")
    return ModelShape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(_first(d, _FFN, 4 * hidden)),
        vocab=int(d["vocab_size"]),
        tied_embeddings=tied_default if tied is None else bool(tied),
        experts=experts,
        experts_per_token=int(d.get("num_experts_per_tok") or 0) if experts else 0,
        expert_intermediate=int(d.get("moe_intermediate_size") or 0) if experts else 0,
        shared_expert_intermediate=shared if experts else 0,
        moe_layers=moe_layers,
    )


def tower_params(d: dict[str, Any]) -> int:
    """A media encoder's parameters: pre-norm encoder blocks (4 H^2 + 2 H I each), a patch embedding and
    position table when the config has them, and its merger into the LM's width (an MLP over
    ``spatial_merge_size``^2 patches, once more per ``deepstack_visual_indexes`` entry), else a projection."""
    hidden, layers = _first(d, _HIDDEN), _first(d, _LAYERS)
    if not hidden or not layers:
        return 0
    ffn = int(_first(d, _FFN, 4 * hidden))
    out = int(_first(d, ("out_hidden_size", "output_dim", "projection_dim"), 0))
    total = int(layers) * (4 * hidden * hidden + 2 * hidden * ffn + 9 * hidden)
    if patch := d.get("patch_size"):
        total += (
            int(d.get("in_channels", 3)) * int(d.get("temporal_patch_size", 1)) * int(patch) ** 2 * hidden
        )
    total += int(d.get("num_position_embeddings") or 0) * hidden
    if merge := d.get("spatial_merge_size"):
        wide = hidden * int(merge) ** 2
        total += (1 + len(d.get("deepstack_visual_indexes") or [])) * (wide * wide + wide * out)
    else:
        total += hidden * out
    return total


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The trained model of a config.json (see the module docstring); a clear error if it has none."""
    candidates = [(d, parent) for d, parent in _subconfigs(config) if _is_lm(d)]
    if not candidates:
        raise ShapeError(
            "config.json: no language model found (no (sub-)config with vocab_size, a layer count "
            "and a hidden size)"
        )
    tied_default = config.get("tie_word_embeddings")
    tied_default = True if tied_default is None else bool(tied_default)
    shapes = [(_lm_shape(d, tied_default), d, parent) for d, parent in candidates]
    lm, lm_dict, parent = max(shapes, key=lambda s: s[0].total_params())
    towers = 0
    if parent is not None:  # the LM's siblings without a vocabulary: the towers the adapter trains with it
        towers = sum(
            tower_params(v)
            for v in parent.values()
            if isinstance(v, dict) and v is not lm_dict and "vocab_size" not in v
        )
    return ModelShape(**{**lm.__dict__, "tower_params": towers})
