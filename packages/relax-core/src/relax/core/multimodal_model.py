"""Loading and calling a model the same way in the engine and the trainer: core's generic text path plus
the dispatch to a model adapter (``relax.core.protocols.ModelAdapter``) registered for the checkpoint's
``config.model_type`` through ``relax_register_model_adapters``.

A plain causal LM needs no adapter: it loads with ``AutoModelForCausalLM`` and never sees media. A model
that takes media (image / video / audio) is run through its adapter, which relax-omni registers for the
Qwen VL / Omni families; a media model with none registered is refused naming its type. Core therefore
holds no model-family code: the names below are what the trainer and the HF engine call, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import torch

from relax.core.protocols import ModelAdapter

ADAPTER_PLUGIN = "relax-omni"  # the in-repo plugin that registers the media model adapters


class UnsupportedModelError(ValueError):
    """A model type that takes media but has no registered adapter."""


def _missing(model_type: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model_type {model_type!r}: {what}, and no plugin registered a model adapter for it "
        f"(relax_register_model_adapters; {ADAPTER_PLUGIN} registers the multimodal ones: install it, or "
        "register one for this type)"
    )


@functools.cache
def _instance(factory: Any) -> ModelAdapter:
    return factory()


def takes_media(adapter: Any) -> bool:
    """Whether core's HF path runs the model through ``adapter`` (a text-only family's adapter, which
    declares ``takes_media = False``, is there for the backends: ``relax.core.model_family``)."""
    return bool(getattr(adapter, "takes_media", True))


def registered_adapter(model_type: str | None) -> ModelAdapter | None:
    """The adapter registered for ``model_type`` (one instance per process), media or text-only."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if not model_type or model_type not in manager.names("model_adapter"):
        return None
    return _instance(manager.get("model_adapter", model_type))


def adapter_for(model_type: str | None) -> ModelAdapter | None:
    """The media adapter registered for ``model_type``, None for a plain causal LM (no adapter, or a text-only
    family's)."""
    adapter = registered_adapter(model_type)
    return adapter if adapter is not None and takes_media(adapter) else None


def model_adapter(model: Any) -> ModelAdapter | None:
    return adapter_for(getattr(getattr(model, "config", None), "model_type", None))


def adapters() -> list[ModelAdapter]:
    """Every registered media adapter (one per distinct factory)."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    factories = {manager.get("model_adapter", name) for name in manager.names("model_adapter")}
    return [a for a in (_instance(f) for f in sorted(factories, key=repr)) if takes_media(a)]


def media_flag_keys() -> frozenset[str]:
    """Processed-input keys any registered adapter declares as per-prompt forward flags."""
    return frozenset(flag for adapter in adapters() for flag in adapter.media_flags)


def model_config(model_path: str) -> Any:
    """The HF config of the model :func:`load_model` returns: the checkpoint's, or the one its adapter loads
    from it (``ModelAdapter.loaded_config``: a whole Qwen-Omni checkpoint's thinker)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    loaded = getattr(adapter_for(config.model_type), "loaded_config", None)
    return config if loaded is None else loaded(config)


def restore_layout(directory: str, model_path: str) -> bool:
    """After ``save_hf`` or ``relax convert`` wrote ``directory``: where the adapter of ``model_path``'s family
    loaded only part of that checkpoint (a whole Qwen-Omni's thinker), it writes ``directory`` back into the
    checkpoint's layout (``ModelAdapter.restore_layout``). True when it did."""
    from transformers import AutoConfig

    restore = getattr(adapter_for(AutoConfig.from_pretrained(model_path).model_type), "restore_layout", None)
    return bool(restore is not None and restore(directory, model_path))


def is_multimodal_model(model_path: str) -> bool:
    """True when the checkpoint's model type has a registered adapter (it takes media)."""
    from transformers import AutoConfig

    return adapter_for(AutoConfig.from_pretrained(model_path).model_type) is not None


def load_model(model_path: str, dtype: str) -> Any:
    """The registered adapter's model for a media checkpoint, else ``AutoModelForCausalLM`` (any causal LM
    transformers loads). A media-only model type (not a causal LM) without an adapter is an error."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(model_path).model_type
    adapter = adapter_for(model_type)
    if adapter is not None:
        return adapter.load(model_path, getattr(torch, dtype))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            raise _missing(model_type, f"{model_path} is an image/audio-text-to-text model")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))


def _tower_prefixes(adapters_: list[ModelAdapter], kinds: Collection[str] | None) -> tuple[str, ...]:
    return tuple(
        p
        for a in adapters_
        for kind, prefixes in a.tower_kinds.items()
        if kinds is None or kind in kinds
        for p in prefixes
    )


def is_tower(name: str, model: Any = None, kinds: Collection[str] | None = None) -> bool:
    """Whether weight ``name`` belongs to a media encoder of ``model`` (any registered adapter's when None),
    of one of ``kinds`` (``"vision"``, ``"audio"``; None: any kind)."""
    adapter = model_adapter(model) if model is not None else None
    found = [adapter] if adapter is not None else ([] if model is not None else adapters())
    return name.startswith(_tower_prefixes(found, kinds))


def tower_kinds(model: Any) -> frozenset[str]:
    """The kinds of media tower ``model`` holds weights of (none for a text-only LM)."""
    adapter = model_adapter(model)
    names = [n for n, _ in model.named_parameters()] if adapter is not None else []
    return frozenset(
        kind
        for kind, prefixes in (adapter.tower_kinds.items() if adapter is not None else ())
        if any(n.startswith(tuple(prefixes)) for n in names)
    )


def kinds_to_freeze(
    present: Collection[str],
    model_type: str | None,
    *,
    freeze_media_towers: bool = False,
    freeze_vision: bool = False,
    freeze_audio: bool = False,
) -> frozenset[str]:
    """The tower kinds a trainer keeps as loaded, from its ``trainer.backend_params`` switches and the kinds
    the model has (``present``): every one with ``freeze_media_towers`` (none is no error: a text-only LM),
    else those switched on. A ``freeze_<kind>: true`` for a tower the model lacks is an error naming the field:
    whoever set it expects a model with that tower, and has another."""
    asked = {kind for kind, on in (("vision", freeze_vision), ("audio", freeze_audio)) if on}
    for kind in sorted(asked - set(present)):
        raise ValueError(
            f"trainer.backend_params.freeze_{kind}: true, but the model (model_type {model_type!r}) has "
            f"no {kind} tower (its towers: {sorted(present) or 'none'}); use a model with one, or "
            f"set freeze_{kind}: false"
        )
    return frozenset(present) if freeze_media_towers else frozenset(asked)


def freeze_switches(params: Any) -> dict[str, bool]:
    """A trainer's ``trainer.backend_params`` freeze switches as keywords (False where it has none)."""
    return {
        key: bool(getattr(params, key, False))
        for key in ("freeze_media_towers", "freeze_vision", "freeze_audio")
    }


def freeze_towers(model: Any, kinds: Collection[str] | None = None) -> frozenset[str]:
    """Stop gradients into the media towers of ``kinds`` (None: every kind); the kinds frozen (none for a
    text-only LM)."""
    frozen = tower_kinds(model) if kinds is None else tower_kinds(model) & frozenset(kinds)
    for name, p in model.named_parameters():
        if is_tower(name, model, frozen):
            p.requires_grad_(False)
    return frozen


def freeze_towers_by_switch(model: Any, **switches: bool) -> frozenset[str]:
    """Freeze the towers the ``trainer.backend_params`` switches (``freeze_switches``) pick for ``model``
    (``kinds_to_freeze``: a switch for a tower it lacks is an error); the kinds frozen."""
    kinds = kinds_to_freeze(tower_kinds(model), getattr(model.config, "model_type", None), **switches)
    return freeze_towers(model, kinds)


def media_token_ids(config: Any) -> list[int]:
    """Placeholder and start/end ids of every media kind the model knows (none for a text-only LM)."""
    adapter = adapter_for(getattr(config, "model_type", None))
    return [] if adapter is None else list(adapter.media_token_ids(config))


def media_forward_kwargs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, torch.Tensor],
    prompt_width: int,
    observed: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments (``input_ids`` included) that make ``model`` see ``media`` for ``input_ids``: its
    adapter's (``ModelAdapter.forward_kwargs``); media for a model type without one is an error.
    ``observed`` (B, R): response positions that are observations (multi-turn), passed on when given."""
    adapter = model_adapter(model)
    if adapter is None:
        raise _missing(getattr(model.config, "model_type", "?"), "a request or row carries media")
    if observed is not None and bool(observed.any()):
        return adapter.forward_kwargs(
            model, input_ids, attention_mask, media, prompt_width, observed=observed.bool()
        )
    return adapter.forward_kwargs(model, input_ids, attention_mask, media, prompt_width)
