"""Multi-latent attention (``MegatronLayout.attention == "mla"``) on megatron-core's own ``MLASelfAttention``:
the HF <-> megatron mapping of its weights and the ``MLATransformerConfig`` fields.

The two sides compute the same thing with the same weight layouts, so the mapping is a renaming plus TP
splits (the down projections and the norms are whole on every TP rank: :func:`local_spec`):

* HF ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` -> ``linear_q_down_proj`` / ``q_layernorm`` /
  ``linear_q_up_proj`` (no query LoRA: HF ``q_proj`` -> ``linear_q_proj``); ``q_b_proj`` rows are per head
  ``[nope; rope]``, as megatron splits them.
* HF ``kv_a_proj_with_mqa`` (``[compressed kv; shared rotary key]``) -> ``linear_kv_down_proj``,
  ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` (per head ``[key nope; value]``) -> ``linear_kv_up_proj``.
* The rotary part: HF's ``rope_interleave`` reorders each head's rotary dims (even, then odd) before
  rotating; megatron's MLA rotary does the same reordering (``multi_latent_attention`` in its
  ``apply_rotary_pos_emb``). Softmax scale ``1 / sqrt(nope + rope)`` on both sides (plain rope, no YaRN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

Tensor = torch.Tensor
ATTN = "self_attention."
#: HF name (under ``self_attn.``) -> (megatron name under ``self_attention.``, TP split dim; None: replicated)
_QUERY_LORA = (
    ("q_a_proj.weight", "linear_q_down_proj.weight", None),
    ("q_a_layernorm.weight", "q_layernorm.weight", None),
    ("q_b_proj.weight", "linear_q_up_proj.weight", 0),
)
_QUERY = (("q_proj.weight", "linear_q_proj.weight", 0),)
_KEY_VALUE = (
    ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight", None),
    ("kv_a_layernorm.weight", "kv_layernorm.weight", None),
    ("kv_b_proj.weight", "linear_kv_up_proj.weight", 0),
    ("o_proj.weight", "linear_proj.weight", 1),
)


def weights(d: Any) -> tuple[tuple[str, str, int | None], ...]:
    return (_QUERY_LORA if d.q_lora_rank else _QUERY) + _KEY_VALUE


def hf_names(d: Any) -> list[str]:
    """A layer's MLA weight names under ``self_attn.``."""
    return ["self_attn." + hf for hf, _, _ in weights(d)]


def to_megatron(hf: Mapping[str, Tensor], h: str, m: str, d: Any, tp: int, rank: int) -> dict[str, Tensor]:
    """One layer's MLA weights (HF prefix ``h``, megatron prefix ``m``), TP rank ``rank``'s: megatron name ->
    the whole tensor (down projections, norms) or the rank's part (``torch.chunk``), only that one made."""
    out: dict[str, Tensor] = {}
    for name, meg, dim in weights(d):
        t = hf[h + "self_attn." + name]
        out[m + ATTN + meg] = t.clone() if dim is None else torch.chunk(t, tp, dim)[rank].clone()
    return out


def to_hf(
    cat: Callable[[str, int], Tensor], one: Callable[[str], Tensor], h: str, m: str, d: Any
) -> dict[str, Tensor]:
    """Inverse of :func:`to_megatron` given the caller's TP gather (``cat``) and replica pick (``one``)."""
    return {
        h + "self_attn." + name: one(m + ATTN + meg) if dim is None else cat(m + ATTN + meg, dim)
        for name, meg, dim in weights(d)
    }


def mla_config(d: Any, kwargs: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """``MLATransformerConfig`` of a multi-latent-attention model from the common ``kwargs`` of
    :func:`relax.megatron.gpt_model.transformer_config`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if d.attention != "mla":
        raise ValueError(
            f"attention {d.attention!r} (multi-latent attention with a sparse-attention indexer) is not "
            "supported by the megatron trainer yet: megatron-core 0.16.1's DSA attention needs Transformer "
            "Engine kernels; use trainer.backend: torch or fsdp for this model"
        )
    if d.rotary_percent != 1.0:
        raise ValueError(
            "multi-latent attention with partial rotary is not supported by the megatron mapping"
        )
    mla = dict(
        multi_latent_attention=True,
        q_lora_rank=d.q_lora_rank or None,
        kv_lora_rank=d.kv_lora_rank,
        qk_head_dim=d.qk_nope_dim,
        qk_pos_emb_head_dim=d.qk_rope_dim,
        v_head_dim=d.v_head_dim,
        rope_type="rope",
        rotary_base=d.rope_theta,
        qk_layernorm=True,  # the low-rank q / kv norms
        kv_channels=d.qk_nope_dim + d.qk_rope_dim,
    )
    return MLATransformerConfig(**{**kwargs, **mla, **overrides})


def local_spec(spec: Any) -> Any:
    """``spec`` (a block spec) made right for MLA on megatron-core 0.16.1's local layers:

    * its ``DotProductAttention`` takes MLA's ``k_channels`` / ``v_channels`` (only Transformer Engine's accepts
      them) and sizes its output by the value heads (:func:`_latent_attention`);
    * the down projections are whole on every TP rank (megatron's plain ``Linear``, as Transformer Engine's spec
      has them), not column-parallel: megatron gathers a column-parallel one's output without summing the shared
      rotary key's gradient over the TP ranks (each holds its heads' part: a TP=2 step's grad norm came out 1.2%
      off), while from a whole one it gathers that key with a reduce-scatter backward. Under sequence
      parallelism each rank's copy sees its slice of the sequence: megatron marks the weight
      ``sequence_parallel``, and its gradient is summed over TP;
    * without Transformer Engine, the MLA module believes TE present when its extension module imported with
      a stand-in for ``TELinear`` (``isinstance(proj, <stand-in>)`` raises): the flag is set right.
    """
    import dataclasses

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from relax.megatron.layer_specs import _swapped

    if not isinstance(multi_latent_attention.TELinear, type):  # TE absent (a stand-in), yet HAVE_TE set
        multi_latent_attention.HAVE_TE = False
    latent, whole = _latent_attention(), multi_latent_attention.Linear

    def fixed(layer: Any) -> Any:
        attention = layer.submodules.self_attention
        parts = dataclasses.replace(attention.submodules, linear_q_down_proj=whole, linear_kv_down_proj=whole)
        layer = dataclasses.replace(
            layer,
            submodules=dataclasses.replace(
                layer.submodules, self_attention=dataclasses.replace(attention, submodules=parts)
            ),
        )
        return _swapped(layer, DotProductAttention, latent)

    return type(spec)(**{**vars(spec), "layer_specs": [fixed(layer) for layer in spec.layer_specs]})


def _latent_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LatentDotProductAttention(DotProductAttention):
        """megatron's local attention with keys of ``k_channels`` and values of ``v_channels`` per head (the
        scores and the softmax scale MLA passes are the parent's; the context is ``v_channels`` wide)."""

        def __init__(
            self,
            config: Any,
            *args: Any,
            k_channels: int | None = None,
            v_channels: int | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return LatentDotProductAttention
