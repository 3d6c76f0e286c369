"""A megatron-core ``GPTModel`` shaped like an HF model: its ``TransformerConfig`` from the family's megatron
layout (``relax.core.model_family.MegatronLayout``, read through :class:`relax.megatron.convert.Dims`) and
the layer spec (local or Transformer Engine; MLA, MoE and dense-then-MoE blocks through megatron's own
block specs). Unloaded: :func:`relax.megatron.convert.load_hf_into` or ``rank_load`` fills it.
"""

from __future__ import annotations

from typing import Any

import torch

from relax.megatron.convert import Dims


def transformer_config(hf_config: Any, **overrides: Any) -> Any:
    """megatron ``TransformerConfig`` equivalent to an HF config (its family's layout), for the local (non-TE) layer spec.

    Fusions that need CUDA kernels are off; ``overrides`` (e.g. ``tensor_model_parallel_size``,
    ``params_dtype``) pass through.
    """
    from megatron.core.transformer import TransformerConfig

    d = Dims.from_hf(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=d.num_layers,
        hidden_size=d.hidden,
        num_attention_heads=d.heads,
        num_query_groups=d.groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=d.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
        init_method_std=d.init_std,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        # kept on although HF weights replace the values: with CPU initialisation megatron sets the TP
        # attributes (tensor_model_parallel, partition_dim) only while initialising (tensor_parallel/layers.py)
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    from relax.megatron.moe import moe_config

    kwargs.update(moe_config(d))
    if d.rotary_sections:
        kwargs["mrope_section"] = list(d.rotary_sections)
    if d.attention != "gqa":
        from relax.megatron.mla import mla_config

        return mla_config(d, kwargs, overrides)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    hf_config: Any,
    pre_process: bool = True,
    post_process: bool = True,
    layer_spec: str = "local",
    vocab_rows: int | None = None,
    **overrides: Any,
) -> Any:
    """An (unloaded) megatron-core ``GPTModel`` shaped like the HF model, for this rank, on the
    ``local`` or Transformer Engine (``te``) layer spec (:mod:`relax.megatron.layer_specs`); ``vocab_rows``:
    the embedding's rows where a checkpoint padded them for another TP size (default: padded for this one).

    Needs ``megatron.core.parallel_state`` to be initialised (:func:`relax.megatron.parallel.initialize_model_parallel`,
    which also applies the CPU patches that running the model needs).
    """
    from megatron.core.models.gpt import GPTModel
    from relax.megatron.layer_specs import gpt_layer_spec

    config = transformer_config(hf_config, **overrides)
    d = Dims.from_hf(hf_config)
    d.check_tp(config.tensor_model_parallel_size)
    sequence_parallel = config.sequence_parallel and layer_spec == "local"
    if d.dense_layers or d.attention != "gqa":  # layers that differ, or MLA: megatron's own block spec
        from relax.megatron.layer_specs import decoder_block_spec

        spec = decoder_block_spec(layer_spec, config, sequence_parallel)
        if d.attention != "gqa" and layer_spec == "local":
            from relax.megatron.mla import local_spec

            spec = local_spec(spec)
    else:
        spec = gpt_layer_spec(
            layer_spec, d.experts or None, qk_layernorm=d.qk_norm, sequence_parallel=sequence_parallel
        )
    if sequence_parallel and not (d.dense_layers or d.attention != "gqa"):
        from relax.megatron.layer_specs import block_spec

        spec = block_spec(spec, config)
    return GPTModel(
        config,
        spec,
        vocab_size=vocab_rows or d.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=d.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope" if d.rotary == "rope" else "mrope",
        rotary_base=d.rope_theta,
        rotary_percent=d.rotary_percent,
    )
