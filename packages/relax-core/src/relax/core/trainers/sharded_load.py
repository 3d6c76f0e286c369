"""Loading an HF checkpoint into a sharded model without a full copy on any rank.

The model is built with its parameters on the meta device (buffers, e.g. rotary frequencies, are computed
as usual), sharded, given empty storage for its shards, and each rank then reads from the safetensors
files only the rows of each weight that its shard holds (``relax.core.safetensors_files``). A rank's host
memory stays near its shard's size instead of the whole model's (issue 39: the 30B Omni thinker on 8 ranks
of one node). The checkpoint's names are mapped to the model's by transformers' own conversion mapping
(renames, and per-expert tensors into the fused expert tensors transformers 5 keeps in memory), as
``from_pretrained`` maps them.

A checkpoint whose mapping needs more than renames and expert merges (none of the families Relax runs) is
reported by :func:`uncovered` before anything is built, and the caller loads it whole instead.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from relax.core.safetensors_files import Checkpoint


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no storage); buffers stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            module._parameters[name] = type(kept)(
                kept.to("meta"), **{**kept.__dict__, "requires_grad": kept.requires_grad}
            )

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_model(model_path: str, dtype: str) -> tuple[Any, dict[str, str] | None]:
    """The model :func:`relax.core.multimodal_model.load_model` would return, parameters on meta, and the
    checkpoint-name ``key_mapping`` its loading applies: the adapter's ``load_empty`` for a media model
    (None when the adapter has none: load whole), ``AutoModelForCausalLM.from_config`` otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relax.core.multimodal_model import adapter_for

    config = AutoConfig.from_pretrained(model_path)
    adapter = adapter_for(config.model_type)
    if adapter is not None:
        build = getattr(adapter, "load_empty", None)
        if build is None:
            return None, None
        with params_on_meta():
            model, key_mapping = build(model_path, getattr(torch, dtype))
    else:
        with params_on_meta():
            model, key_mapping = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)), None
    if model.can_generate():  # as from_pretrained: the checkpoint's generation defaults, where it has them
        from transformers import GenerationConfig

        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model, key_mapping


class Plan:
    """Where each checkpoint tensor goes in ``model``: ``direct`` (model name per checkpoint name) and
    ``experts`` (checkpoint name -> (fused model name, expert, rule)); ``unknown``: checkpoint names that
    map to no weight (a whole Omni checkpoint's talker: left unread, as ``from_pretrained`` leaves them)."""

    def __init__(self, model: Any, names: list[str], key_mapping: dict[str, str] | None) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, apply_renamings, rename_source_key

        from relax.core.engines.weight_names import expert_rules, fused_slot

        conversions = get_model_conversion_mapping(model, key_mapping)
        renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        wanted = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        rules = expert_rules(model)
        self.direct: dict[str, str] = {}
        self.experts: dict[str, tuple[str, int, Any]] = {}
        self.unknown: list[str] = []
        self.renamed: dict[str, str] = {}  # every name after the renames alone (an expert still per expert)
        for name in names:
            target, pattern = rename_source_key(name, renamings, converters, prefix, wanted)
            self.renamed[name] = apply_renamings(name, renamings)
            slot = fused_slot(self.renamed[name], rules) if pattern is not None else None
            if pattern is None and target in wanted:
                self.direct[name] = target
            elif slot is not None and slot[0] in wanted:
                self.experts[name] = slot
            else:
                self.unknown.append(name)

    def covered(self) -> set[str]:
        return set(self.direct.values()) | {slot[0] for slot in self.experts.values()}

    def only(self, names: set[str]) -> Plan:
        """This plan for the weights ``names`` only (what is left of a model after parts were dropped)."""
        kept = copy.copy(self)
        kept.direct = {k: v for k, v in self.direct.items() if v in names}
        kept.experts = {k: v for k, v in self.experts.items() if v[0] in names}
        return kept


def uncovered(model: Any, plan: Plan) -> list[str]:
    """Parameters of ``model`` (each under any of its tied names) that no checkpoint tensor fills."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    covered = plan.covered()
    return sorted(group[0] for group in names.values() if not covered.intersection(group))


def local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's tensor behind a (possibly sharded) weight, and its offset in the full tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return value.to_local(), tuple(offset)


def _rows(local: torch.Tensor, offset: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, int] | None:
    """The rows of dim 0 this shard holds when it is whole along every other dim (a contiguous read)."""
    if local.dim() == 0 or tuple(local.shape[1:]) != tuple(full[1:]) or any(offset[1:]):
        return None
    return offset[0], offset[0] + local.shape[0]


def fill(model: Any, checkpoint: Checkpoint, plan: Plan) -> int:
    """Copy every rank's part of every weight from ``checkpoint`` (read: only that part) into ``model``,
    whose parameters already have (empty) storage; the elements read. Every parameter element must be
    written (checked), so a shard is never left uninitialised."""
    from relax.core.engines.weight_names import expert_view

    state = model.state_dict(keep_vars=True)
    written: dict[int, int] = {}
    read = 0
    with torch.no_grad():
        for name, target in plan.direct.items():
            local, offset = local_part(state[target])
            full = checkpoint.shape(name)
            if tuple(full) != tuple(state[target].shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} {tuple(full)} does not fit {target!r} {tuple(state[target].shape)}"
                )
            rows = _rows(local, offset, full)
            if rows is not None:  # straight into the shard's memory where it can
                checkpoint.read_into(name, local, rows)
            else:  # sharded along another dim: read it whole, keep this rank's slice
                whole = checkpoint.read(name)
                local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))])
            read += local.numel()
            written[id(state[target])] = written.get(id(state[target]), 0) + local.numel()
        for name, (target, expert, rule) in plan.experts.items():
            local, offset = local_part(state[target])
            if not offset[0] <= expert < offset[0] + local.shape[0]:
                continue  # another rank's expert: not read here
            view = expert_view(local, expert - offset[0], rule)
            if view is None or tuple(view.shape) != checkpoint.shape(name):
                raise ValueError(
                    f"checkpoint tensor {name!r} {checkpoint.shape(name)} does not fit expert {expert} of {target!r}"
                )
            view.copy_(checkpoint.read(name).to(view.dtype))
            read += view.numel()
            written[id(state[target])] = written.get(id(state[target]), 0) + view.numel()
    short = [n for n, p in model.named_parameters() if written.get(id(p), 0) < local_part(p)[0].numel()]
    if short:
        raise ValueError(f"the sharded load left {len(short)} weight(s) partly unwritten: {short[:5]}")
    return read


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give the meta parameters empty storage on ``device`` (FSDP2's shards stay shards), keeping the
    buffers' values (``to_empty`` would leave them uninitialised too)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
