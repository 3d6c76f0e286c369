"""Which megatron-core layer spec builds the model: Transformer Engine's when it is installed, else the
local (plain torch) one; and the few weight names in which the two differ.

Transformer Engine is optional (CUDA only, built for the installed torch: docs/gpu.md): its spec gives fused
kernels and flash attention (with :mod:`relax.megatron.padding`'s right padding, no mask tensor at
all). ``layer_spec: auto`` takes it whenever ``transformer_engine`` imports on a CUDA device; ``local``
always works (CPU included), ``te`` insists. The HF mapping (:mod:`relax.megatron.convert`) is written
for the local names; :func:`to_te_names` / :func:`from_te_names` translate the norms that TE fuses into
the following linear layer (``input_layernorm`` into ``linear_qkv``, and in a dense MLP
``pre_mlp_layernorm`` into ``linear_fc1``). Checkpoints keep the names of the spec that wrote them.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from typing import Any, Literal

LayerSpec = Literal["auto", "te", "local"]
LAYER_SPECS: tuple[str, ...] = ("auto", "te", "local")

# local name -> TE name, per decoder layer (the dense MLP's fc1 norm only: an MoE layer keeps its own norm)
_ATTN_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
# a decoder layer's weight: ``decoder.layers.<i>.<rest>`` (state dicts) or ``decoder.layers.<rest>`` (the keys
# of megatron's sharded state dicts, which stack the layers)
_LAYER = re.compile(r"^(.*decoder\.layers\.(?:\d+\.)?)(.+)$")


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` can be imported (found and importable: a wheel built for another
    CUDA/torch fails at import, and counts as absent)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return False
    return True


def resolve_layer_spec(
    choice: str, device_type: str, te_available: bool | None = None
) -> Literal["te", "local"]:
    """``auto`` -> ``te`` on CUDA with Transformer Engine importable, else ``local``; ``te`` without it
    (or on CPU) is an error that says how to get it."""
    if choice not in LAYER_SPECS:
        raise ValueError(f"layer_spec={choice!r}: expected one of {list(LAYER_SPECS)}")
    have_te = transformer_engine_available() if te_available is None else te_available
    if choice == "local":
        return "local"
    if choice == "te":
        if device_type != "cuda":
            raise ValueError("layer_spec: te needs device: cuda (Transformer Engine has no CPU kernels)")
        if not have_te:
            raise ValueError(
                "layer_spec: te needs Transformer Engine (transformer_engine.pytorch) built for this "
                "torch (docs/gpu.md#transformer-engine); or layer_spec: auto / local"
            )
        return "te"
    return "te" if device_type == "cuda" and have_te else "local"


def gpt_layer_spec(
    kind: str, num_experts: int | None, qk_layernorm: bool = True, sequence_parallel: bool = False
) -> Any:
    """megatron's GPT decoder-layer spec for Qwen3 (RMSNorm, per-head q/k norms; Qwen2 LMs: none), TE or local.

    ``sequence_parallel`` (local spec): megatron's torch norm wrapper refuses it by assertion only (an RMSNorm
    normalises each token alone, so a sequence slice is fine); :class:`SequenceParallelNorm` stands in for it
    and marks its weight ``sequence_parallel`` (its gradient is then summed over TP); see :func:`block_spec`."""
    from megatron.core.models.gpt import gpt_layer_specs

    if kind == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )
    if not sequence_parallel:
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return _swapped(spec, WrappedTorchNorm, SequenceParallelNorm)


def block_spec(layer_spec: Any, config: Any) -> Any:
    """A whole block's submodules from a :func:`gpt_layer_spec` with sequence parallelism (local spec): its
    final norm a :class:`SequenceParallelNorm` too (megatron picks its own norm for a plain layer spec)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=SequenceParallelNorm
    )


def decoder_block_spec(kind: str, config: Any, sequence_parallel: bool = False) -> Any:
    """megatron's own per-layer block spec, for families whose layers differ (dense first layers, then MoE:
    ``moe_layer_freq``) or whose attention is multi-latent (``config.multi_latent_attention``); under sequence
    parallelism (local spec) every norm a :class:`SequenceParallelNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=kind == "te", normalization="RMSNorm")
    if kind == "te" or not sequence_parallel:
        return block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layers = [_swapped(spec, WrappedTorchNorm, SequenceParallelNorm) for spec in block.layer_specs]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelNorm)


class SequenceParallelNorm:
    """megatron's ``WrappedTorchNorm`` (torch's RMSNorm / LayerNorm) for a sequence-parallel model: the weight
    is marked ``sequence_parallel`` as megatron's fused norms mark theirs (its gradient is a per-slice sum)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> Any:
        import torch

        kind = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = kind(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _swapped(spec: Any, old: Any, new: Any) -> Any:
    """``spec`` (megatron ``ModuleSpec`` / submodule dataclasses, nested) with every ``old`` module replaced."""
    import dataclasses

    if spec is old:
        return new
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    changes = {f.name: _swapped(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not getattr(spec, k)})


def _renamed(name: str, pairs: list[tuple[str, str]]) -> str:
    match = _LAYER.match(name)
    if not match:
        return name
    prefix, rest = match.groups()
    return prefix + next((new for old, new in pairs if rest == old), rest)


def te_name(name: str, moe: bool) -> str:
    """A local-spec megatron weight name (or sharded-state-dict key) -> the TE spec's."""
    return _renamed(name, [_ATTN_NORM] if moe else [_ATTN_NORM, _MLP_NORM])


def to_te_names(tensors: Mapping[str, Any], moe: bool) -> dict[str, Any]:
    """Local-spec megatron names -> the TE spec's (a new dict, same values)."""
    return {te_name(n, moe): t for n, t in tensors.items()}


def from_te_names(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`to_te_names` (an MoE layer has no ``linear_fc1.layer_norm_weight`` to rename)."""
    pairs = [(te, local) for local, te in (_ATTN_NORM, _MLP_NORM)]
    return {_renamed(n, pairs): t for n, t in tensors.items()}


def uses_te_names(names: Any) -> bool:
    """Whether a model's state-dict names are the TE spec's."""
    return any(n.endswith(_ATTN_NORM[1]) for n in names)


def megatron_core_version() -> str:
    """The installed megatron-core version (what the GPU check prints next to its results)."""
    from importlib.metadata import version

    return version("megatron-core")
