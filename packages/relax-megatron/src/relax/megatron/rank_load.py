"""Each megatron rank reads only the HF tensors its TP x PP x EP shard is made of; ``save_hf`` streams.

Before issue 39 every rank read the whole checkpoint and built every TP x EP shard of it. Here the HF ->
megatron mapping of one rank (``convert.hf_to_megatron_rank``, whatever family it maps) runs once per unit
of the checkpoint (one decoder layer, or one top-level weight) on a view of it in which that unit's tensors
are read from disk and every other tensor is an empty meta tensor of the right shape: the mapping's torch
ops run on both, and only the non-meta results are kept and copied into the model. So a rank reads the
layers of its pipeline stage, of an MoE layer the experts of its EP rank only, and the embedding or head
only where its stage holds them. The mapping cuts each tensor it reads to this TP rank's part before
fusing (q/k/v, gate/up) and drops it, so a rank holds at most one of the unit's tensors whole at a time
plus its own part of the unit, never the other TP ranks' parts. Which top-level weights a stage holds is
asked of the mapping too: each is run as a float64 meta tensor among float32 ones, and the float64
results (type promotion carries the mark) are what it feeds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from relax.core.safetensors_files import Checkpoint
from relax.megatron.host_memory import large_blocks_returned

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


class PartialCheckpoint(Mapping):
    """``{name: tensor}`` over a checkpoint: the ``real`` names read from disk, the rest meta tensors
    (``meta_dtype`` when given, for the provenance probe)."""

    def __init__(
        self, checkpoint: Checkpoint, real: set[str], meta_dtype: dict[str, torch.dtype] | None = None
    ):
        self.checkpoint, self.real, self.meta_dtype = checkpoint, real, meta_dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.checkpoint.entries[name]
        if name in self.real:
            return self.checkpoint.read(name)
        dtype = entry.dtype if self.meta_dtype is None else self.meta_dtype.get(name, torch.float32)
        return torch.empty(entry.shape, dtype=dtype, device="meta")

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.entries)

    def __len__(self) -> int:
        return len(self.checkpoint.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.checkpoint.entries


def no_init(weight: torch.Tensor) -> None:
    """Megatron's init method for a model whose weights are loaded next: with CPU initialisation megatron
    allocates each TP-split weight whole and initialises it before keeping this rank's part; left untouched,
    the whole weight's pages are never written, so a rank's memory holds its part only."""


def units(names: list[str]) -> dict[Any, list[str]]:
    """Checkpoint names by unit: ``("layer", i)`` for decoder layer ``i``'s, ``("top", name)`` otherwise."""
    out: dict[Any, list[str]] = {}
    for name in names:
        m = LAYER.search(name)
        out.setdefault(("layer", int(m.group(1))) if m else ("top", name), []).append(name)
    return out


@large_blocks_returned()  # each unit's temporaries leave the resident set when freed
def load_rank(
    model: Any,
    model_dir: str | Checkpoint,
    hf_config: Any,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
) -> int:
    """Fill ``model`` (this TP / EP rank's shard of pipeline stage ``pp_rank``) from the HF checkpoint at
    ``model_dir`` (or a :class:`Checkpoint` view of one under the LM's names, ``media_front``), reading only
    what it holds; every model weight must be filled. The tensors read."""
    from relax.megatron import convert
    from relax.megatron.layer_specs import to_te_names, uses_te_names

    checkpoint = model_dir if isinstance(model_dir, Checkpoint) else Checkpoint(model_dir)
    d = convert.Dims.from_hf(hf_config)
    stage = convert.stage_layers(d.num_layers, pp, pp_rank)
    per_ep = d.experts // ep if d.experts else 0
    params = model.state_dict()
    expected = set(convert.weights_only(params))
    te = uses_te_names(expected)

    def rank_part(view: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shard = convert.to_stage(
            convert.hf_to_megatron_rank(view, hf_config, tp, tp_rank, ep, ep_rank), hf_config, pp, pp_rank
        )
        return to_te_names(shard, moe=bool(d.experts)) if te else shard

    def made_from(names: list[str]) -> dict[str, torch.Tensor]:  # this rank's weights a top-level unit makes
        marked = rank_part(PartialCheckpoint(checkpoint, set(), {n: torch.float64 for n in names}))
        return {n: t for n, t in marked.items() if t.dtype == torch.float64}

    def vocab_slice(names: list[str], made: dict[str, torch.Tensor]) -> tuple[str, str, int, int] | None:
        """(HF name, weight, first row, rows) when the unit is an embedding / head split by vocabulary rows
        (``convert._vocab_part``): this rank reads only its rows, straight into its weight (no whole copy and
        no split copy, at TP 1 too); the padding rows past the vocabulary are 0."""
        shape = checkpoint.entries[names[0]].shape
        if len(names) != 1 or len(made) != 1 or shape[:1] != (d.vocab,):
            return None
        [(target, probe)], rows = made.items(), d.padded_vocab(tp) // tp
        if target not in expected or tuple(probe.shape) != (rows, *shape[1:]):
            return None
        return names[0], target, tp_rank * rows, max(0, min(rows, d.vocab - tp_rank * rows))

    def mine(name: str) -> bool:  # an expert of another EP rank is not read
        m = EXPERT.search(name)
        return m is None or not per_ep or int(m.group(1)) // per_ep == ep_rank

    written: set[str] = set()
    read = 0
    for (kind, key), names in units(list(checkpoint.entries)).items():
        made = made_from(names) if kind == "top" else None
        if (kind == "layer" and key not in stage) or made == {}:
            continue
        if made and (rows := vocab_slice(names, made)):
            name, target, start, count = rows
            with torch.no_grad():
                params[target][count:].zero_()
                checkpoint.read_into(
                    name, params[target][:count], (start, start + count)
                )  # into the weight itself
            written.add(target)
            read += 1
            continue
        real = {n for n in names if mine(n)}
        read += len(real)
        with torch.no_grad():
            for name, value in rank_part(PartialCheckpoint(checkpoint, real)).items():
                if value.device.type != "meta" and name in expected:
                    params[name].copy_(value)
                    written.add(name)
    if missing := sorted(expected - written):
        raise ValueError(
            f"{model_dir}: the checkpoint did not fill {len(missing)} megatron weight(s): {missing[:8]}"
        )
    return read


def save_streamed(
    directory: str,
    export: Iterable[list[tuple[str, torch.Tensor]]],
    towers: Iterable[tuple[str, torch.Tensor]],
    hf_config: Any,
    model_path: str,
) -> None:
    """``save_hf``: every rank runs the export (its units are gathered one at a time), rank 0 appends each
    tensor to the current safetensors shard and writes config and tokenizer (``checkpoint.write_hf``);
    ``towers``: a media model's frozen towers (not exported, but the directory is the whole model)."""
    import torch.distributed as dist

    from relax.core.safetensors_files import ShardWriter
    from relax.megatron.checkpoint import write_hf

    writer = ShardWriter(directory) if dist.get_rank() == 0 else None
    for bucket in export:  # every rank takes part in each unit's gathers
        for name, tensor in bucket if writer is not None else ():
            writer.add(name, tensor)
    if writer is not None:
        for name, p in towers:
            writer.add(name, p.detach())
        writer.close()
        write_hf(directory, None, hf_config, model_path)  # with a media model's processor
