"""LoRA on the torch trainer (``trainer.lora``), through ``peft``.

The base model stays frozen in the compute dtype; only the adapters and ``modules_to_save`` (both fp32:
the master copy) get gradients and optimizer state. A weight sync moves only what training changes: each adapted
linear layer's ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``, already scaled by ``alpha / r``),
named after the HF module they adapt (``model.layers.0.self_attn.q_proj.lora_A.weight``, the PEFT
adapter file's names without its ``base_model.model.`` prefix), plus ``modules_to_save`` under
their plain HF names. A receiver then needs no LoRA config: ``W = W0 + lora_B @ lora_A``
(``relax.core.engines.lora_merge``). Bytes per sync are proportional to the rank, not the model.

The reference policy is the same module with the adapters disabled (:func:`base_only`): no second
copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

#: what ``model.named_modules()`` of a ``PeftModel`` puts before the HF module names
PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_ADAPTER = "default"  # peft's adapter name; one adapter per trainer


def add_adapters(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """``model`` wrapped by ``peft`` with fresh adapters (B = 0: the policy starts as the base); the base
    frozen, the adapters and ``modules_to_save`` trainable in fp32. Only linear layers may be adapted
    (what every engine can merge)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear

    targets = lora.target_modules
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        bias="none",
        target_modules=targets[0] if list(targets) == ["all-linear"] else list(targets),
        modules_to_save=list(lora.modules_to_save) or None,
    )
    embedding = model.get_input_embeddings().weight
    peft_model = get_peft_model(model, config)  # autocast_adapter_dtype: adapters in fp32 on a bf16 base
    upcast_modules_to_save(peft_model)  # peft leaves those in the base's dtype
    for name, module in peft_model.named_modules():
        if not (hasattr(module, "lora_A") and module.lora_A):
            continue
        if not isinstance(module, Linear):
            raise ValueError(
                f"trainer.lora.target_modules: {hf_name(name)} ({type(module).__name__}) cannot be "
                "adapted (only linear layers: their adapters merge into the engines' weights)"
            )
        if module.base_layer.weight is embedding:
            raise ValueError(
                f"trainer.lora.target_modules: {hf_name(name)} shares its weight with the input "
                "embeddings (tie_word_embeddings): an engine merging its adapter would change both"
            )
    return peft_model


def upcast_modules_to_save(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each ``modules_to_save`` copy in fp32, like every other trained weight: peft's ``autocast_adapter_dtype``
    upcasts only the adapters, so on a bf16 base AdamW would step bf16 copies with bf16 moments and round an
    RL-sized update (lr 1e-6) away. A copy then computes in fp32 (its floating inputs upcast) and hands the
    base's dtype on, as peft's adapters do. The copies changed (none on an fp32 base)."""
    from peft.utils.other import ModulesToSaveWrapper

    changed = []
    for module in model.modules():
        if not isinstance(module, ModulesToSaveWrapper) or _ADAPTER not in module.modules_to_save:
            continue
        copy = module.modules_to_save[_ADAPTER]
        low = {p.dtype for p in copy.parameters() if p.is_floating_point() and p.dtype != torch.float32}
        if not low:
            continue
        base_dtype = low.pop()
        copy.float()
        copy.register_forward_pre_hook(_fp32_inputs, with_kwargs=True)
        copy.register_forward_hook(lambda _m, _args, out, dtype=base_dtype: _cast_floating(out, dtype))
        changed.append(copy)
    return changed


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_cast_floating(v, dtype) for v in value)
    return value


def _fp32_inputs(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _cast_floating(args, torch.float32), {
        k: _cast_floating(v, torch.float32) for k, v in kwargs.items()
    }


def hf_name(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX)


def adapter_tensors(
    model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight sync sends: per adapted layer ``lora_A`` and ``scaling * lora_B`` (adjacent, so one
    bucket usually holds both), then ``modules_to_save`` by HF name; detached, fp32. ``state``: take the
    tensors from this ``model.state_dict()``-named dict instead of the live modules (the FSDP trainer's
    gathered full weights; the live ones are shards)."""
    from peft.utils.other import ModulesToSaveWrapper

    def weight(name: str, param: torch.Tensor) -> torch.Tensor:
        return (param if state is None else state[name]).detach()

    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and _ADAPTER in getattr(module, "lora_A", {}):
            a = weight(f"{name}.lora_A.{_ADAPTER}.weight", module.lora_A[_ADAPTER].weight)
            b = (
                weight(f"{name}.lora_B.{_ADAPTER}.weight", module.lora_B[_ADAPTER].weight)
                * module.scaling[_ADAPTER]
            )
            yield f"{hf_name(name)}.lora_A.weight", a
            yield f"{hf_name(name)}.lora_B.weight", b
        elif isinstance(module, ModulesToSaveWrapper):
            for pname, p in module.modules_to_save[_ADAPTER].named_parameters():
                yield f"{hf_name(name)}.{pname}", weight(f"{name}.modules_to_save.{_ADAPTER}.{pname}", p)


def adapter_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes one adapter sync moves (``dtype``: what floating tensors are sent in; None: as they are)."""
    size = 0
    for _, t in adapter_tensors(model):
        size += t.numel() * (
            dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        )
    return size


def base_only(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """The reference policy: ``model`` with its adapters (and ``modules_to_save``) disabled."""
    return model.disable_adapter()


@contextmanager
def dropout_active(model: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout on for the training forwards (the model is otherwise in eval mode)."""
    dropouts = [
        m.lora_dropout[_ADAPTER] for m in model.modules() if _ADAPTER in getattr(m, "lora_dropout", {})
    ]
    for d in dropouts:
        d.train()
    try:
        yield
    finally:
        for d in dropouts:
            d.eval()


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter and ``modules_to_save`` weights (what a checkpoint keeps; the base is the model path's)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k or "modules_to_save" in k]
    if missing:
        raise ValueError(f"LoRA checkpoint: adapter tensors this model has no place for: {missing[:5]}")


def merged_state_dict(
    model: torch.nn.Module, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base's HF state dict with the adapter merged (``W0 + scaling * B @ A``, in fp32, cast to
    ``dtype``) and ``modules_to_save`` in place of the originals; the live model is left as it is.
    ``state``: the full ``model.state_dict()`` to merge from (see :func:`adapter_tensors`)."""
    adapters = dict(adapter_tensors(model, state))
    deltas = {name.removesuffix(".lora_A.weight") for name in adapters if name.endswith(".lora_A.weight")}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in (model.state_dict() if state is None else state).items():
        hf = hf_name(name)
        if ".lora_" in hf or ".original_module." in hf:
            continue
        hf = hf.replace(".base_layer.", ".").replace(f".modules_to_save.{_ADAPTER}.", ".")
        module = hf.removesuffix(".weight")
        if hf.endswith(".weight") and module in deltas:
            a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
            tensor = tensor.float() + b.float() @ a.float()
        out[hf] = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
    return out


def save_final(
    model: torch.nn.Module,
    tokenizer: Any,
    directory: str,
    dtype: torch.dtype,
    merged: bool,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """``directory``: the adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``;
    ``PeftModel.from_pretrained(base, directory)`` loads it) and the tokenizer; with ``merged`` also
    ``directory/merged``: plain HF weights with the adapter merged in. ``state``: the full
    ``model.state_dict()`` to write (see :func:`adapter_tensors`; the adapter's entries suffice
    without ``merged``)."""
    model.save_pretrained(directory, safe_serialization=True, state_dict=state)
    tokenizer.save_pretrained(directory)
    if merged:
        target = Path(directory) / "merged"
        base = model.get_base_model()
        base.save_pretrained(
            target, state_dict=merged_state_dict(model, dtype, state), safe_serialization=True
        )
        tokenizer.save_pretrained(target)
