"""The FSDP trainer's state on disk and on the wire: sharded checkpoints, full tensors, HF export.

Checkpoints are ``torch.distributed.checkpoint`` directories: each rank writes its own shards, and
a load re-shards to whatever world size loads them (resume at 1 what was saved at 2). The step
counter and RNG states ride along in a small file rank 0 writes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SHARDS_DIR = "fsdp"  # the DCP directory inside a checkpoint
META_FILE = "fsdp_trainer_state.pt"
HF_DIR = "hf_config"  # config + tokenizer: what ``relax convert`` needs besides the shards
CLASS_FILE = "transformers_class.txt"  # the model's transformers class (an Omni thinker is no Auto class)


def gathered(value: torch.Tensor, comm_device: torch.device) -> torch.Tensor:
    """The full tensor behind a (possibly sharded) weight: an all-gather for a DTensor (a
    collective: every rank calls it), the tensor itself otherwise. Offloaded shards are moved to
    the communication device first."""
    from torch.distributed.tensor import DTensor

    value = value.detach()
    if not isinstance(value, DTensor):
        return value
    local = value.to_local()
    if local.device != comm_device:
        value = DTensor.from_local(
            local.to(comm_device),
            value.device_mesh,
            value.placements,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.full_tensor()


def _options(lora: bool) -> Any:
    """LoRA: the trained weights only (the adapter and ``modules_to_save``; the frozen base is the
    model path's), so a load leaves the base as loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if lora else None


def _states(model: torch.nn.Module, optimizer: Any, lora: bool) -> dict[str, Any]:
    """What a checkpoint holds: model and optimizer state (DTensor shards), as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        return {"model": model.state_dict(), "optim": {}}
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(lora))
    if lora:  # a frozen weight tied to another (lm_head to the embeddings) stays under its second name
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trained}
    return {"model": model_state, "optim": optim_state}


def _hf_model(model: torch.nn.Module, lora: bool) -> torch.nn.Module:
    return model.get_base_model() if lora else model  # a peft model's HF model


def save(
    directory: str,
    model: torch.nn.Module,
    optimizer: Any,
    meta: dict[str, Any],
    rank: int,
    tokenizer: Any,
    lora: bool = False,
) -> None:
    """``lora``: ``model`` is a peft model; the adapter and its optimizer state are saved."""
    import torch.distributed.checkpoint as dcp

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_states(model, optimizer, lora), checkpoint_id=str(path / SHARDS_DIR))
    if rank == 0:
        torch.save({**meta, "lora": lora}, path / META_FILE)
        hf = _hf_model(model, lora)
        hf.config.save_pretrained(path / HF_DIR)
        tokenizer.save_pretrained(path / HF_DIR)
        (path / HF_DIR / CLASS_FILE).write_text(hf_class(hf).__name__)
    dist.barrier()  # every rank's shards are written before anyone calls the checkpoint done


def is_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return (path / SHARDS_DIR / ".metadata").is_file() and (path / HF_DIR / CLASS_FILE).is_file()


def to_hf(checkpoint: str, hf_dir: str) -> int:
    """``relax convert`` for an fsdp checkpoint, offline (no process group): the shards are read
    straight into a plain fp32 HF model of the saved config, written with its tokenizer."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path = Path(checkpoint)
    if torch.load(path / META_FILE, weights_only=False).get("lora", False):
        raise ValueError(
            f"{checkpoint}: a LoRA checkpoint holds the adapter only (the base is model.path's); "
            "its final export (checkpoint.save_hf_final) writes the PEFT adapter and, with "
            "trainer.lora.export_merged, merged HF weights"
        )
    config = transformers.AutoConfig.from_pretrained(path / HF_DIR)
    model = getattr(transformers, (path / HF_DIR / CLASS_FILE).read_text().strip())._from_config(config)
    wanted = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    dcp.load(
        wanted,
        checkpoint_id=str(path / SHARDS_DIR),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    model.tie_weights()
    model.save_pretrained(hf_dir, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(path / HF_DIR).save_pretrained(hf_dir)
    return len(wanted)


def load(directory: str, model: torch.nn.Module, optimizer: Any, lora: bool = False) -> dict[str, Any]:
    """Load the shards into this world's layout; the saved step and RNG states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(directory)
    if not (path / SHARDS_DIR).is_dir() or not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"{directory}: not an fsdp trainer checkpoint (no {SHARDS_DIR}/ or {META_FILE})"
        )
    meta = torch.load(path / META_FILE, weights_only=False)
    if meta.get("lora", False) != lora:
        raise ValueError(
            f"{directory}: checkpoint {'has' if meta.get('lora') else 'has no'} LoRA adapter, "
            f"but trainer.lora is {'set' if lora else 'null'}"
        )
    loaded = _states(model, optimizer, lora)
    dcp.load(
        loaded, checkpoint_id=str(path / SHARDS_DIR)
    )  # a trained tensor the checkpoint lacks is an error
    if optimizer is not None:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optim"],
            options=_options(lora),
        )
    else:
        model.load_state_dict(loaded["model"])
    return meta


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])


def hf_class(model: torch.nn.Module) -> type:
    """The transformers class an FSDP-wrapped model was built from (FSDP2 swaps in a subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def save_hf(
    directory: str,
    model: torch.nn.Module,
    tokenizer: Any,
    dtype: torch.dtype,
    rank: int,
    comm_device: torch.device,
    max_shard_bytes: int = 50 * 10**9,  # save_pretrained's default "50GB"
) -> None:
    """A plain HF directory, as ``save_pretrained`` of the unwrapped model writes it, streamed (a
    collective): each weight is gathered in full one at a time and rank 0 appends it to the current
    safetensors shard, so no rank ever holds the whole model. Names and layout are transformers' own
    (tied copies dropped, fused experts written back per expert); ``config.json`` names the
    transformers architecture, not FSDP's wrapper."""
    from relax.core.safetensors_files import ShardWriter
    from relax.core.trainers.export import in_dtype

    plain = plain_model(model)
    plain.config.dtype = str(dtype).removeprefix("torch.")
    keep = saved_names(plain)
    writer = ShardWriter(directory, max_shard_bytes) if rank == 0 else None
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in keep:
            continue
        full = gathered(value, comm_device)  # every rank, in the same order
        if writer is not None:
            for saved, tensor in original_format(plain, name, in_dtype(full, dtype)).items():
                writer.add(saved, tensor)
    if writer is not None:
        writer.close()
        plain.config.save_pretrained(directory)
        if plain.can_generate():
            getattr(model, "generation_config", plain.generation_config).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    dist.barrier()


def plain_model(model: torch.nn.Module) -> Any:
    """An unwrapped model of ``model``'s transformers class and config, on meta (names and mappings only)."""
    with torch.device("meta"):
        plain = hf_class(model)._from_config(model.config)
    plain.config.architectures = [type(plain).__name__]
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    # what revert_weight_conversion would look up on every call (save_pretrained's: no legacy names)
    conversions = get_model_conversion_mapping(plain, add_legacy=False)
    plain._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)] or None
    return plain


def saved_names(plain: Any) -> set[str]:
    """The state-dict names ``save_pretrained`` writes (one of each tied group; no ignored keys)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    names = remove_tied_weights_from_state_dict(plain.state_dict(), plain)
    return set(names) - set(plain._keys_to_ignore_on_save or ())


def original_format(plain: Any, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One in-memory weight as the checkpoint names it (``save_pretrained``'s reverse conversion: a fused
    expert tensor becomes one tensor per expert), on the host."""
    from transformers.core_model_loading import revert_weight_conversion

    return {
        n: t.detach().cpu().contiguous() for n, t in revert_weight_conversion(plain, {name: tensor}).items()
    }


def save_adapter(
    directory: str,
    model: torch.nn.Module,
    tokenizer: Any,
    dtype: torch.dtype,
    rank: int,
    merged: bool,
    comm_device: torch.device,
) -> None:
    """LoRA's final export (``relax.core.trainers.lora.save_final``) from full tensors gathered to rank 0
    (a collective): the trained ones, or with ``merged`` the whole model (rank 0's host memory)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from relax.core.trainers import lora as lora_adapters

    if merged:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        first: dict[int, str] = {}
        for name, p in model.named_parameters(
            remove_duplicate=False
        ):  # tied weights were gathered apart: tie them
            tied = first.setdefault(id(p), name)
            if tied != name and tied in full and name in full:
                full[name] = full[tied]  # so save_pretrained writes the weight once, as without FSDP
    else:  # the adapter and modules_to_save, one tensor at a time
        full = {
            name: gathered(p, comm_device).cpu() for name, p in model.named_parameters() if p.requires_grad
        }
    if rank == 0:
        lora_adapters.save_final(model, tokenizer, directory, dtype, merged, state=full)
    dist.barrier()
