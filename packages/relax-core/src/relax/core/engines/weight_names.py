"""Per-expert HF weight names → the fused expert tensors transformers 5 keeps in memory.

transformers 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``), while checkpoints on disk, SGLang and the megatron trainer's
export name each expert (``mlp.experts.3.gate_proj.weight``). A weight sync may carry either, and a
bucket may hold only some experts of a layer, so each per-expert tensor is written straight into its
slice of the fused tensor instead of being merged first.

The rules are read from transformers' own checkpoint conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``, what ``from_pretrained`` applies):
every ``WeightConverter`` whose operations are ``MergeModulelist(dim=0)`` optionally followed by
``Concatenate(dim=d)``. A model without such converters gets no rules (then a per-expert name stays an
unknown name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ExpertRule:
    """``source`` (matching a name's per-expert part, expert index in group 1) → ``target``; the tensor is
    part ``part`` of ``parts`` equal chunks along ``dim`` of one expert's slice of the fused tensor."""

    source: re.Pattern[str]
    target: str
    part: int
    parts: int
    dim: int
    scope: str | None = None


def rules_from_converters(converters: list[Any]) -> list[ExpertRule]:
    """The per-expert rules among transformers ``WeightConverter``s (others are ignored)."""
    rules = []
    for conv in converters:
        ops = getattr(conv, "operations", None) or []
        kinds = [type(op).__name__ for op in ops]
        if kinds[:1] != ["MergeModulelist"] or ops[0].dim != 0 or kinds[1:] not in ([], ["Concatenate"]):
            continue
        if len(conv.target_patterns) != 1 or any(s.count("*") != 1 for s in conv.source_patterns):
            continue
        # Concatenate's dim counts the stacked expert dim; one expert's slice has one dim less
        dim = ops[1].dim - 1 if len(ops) == 2 else 0
        if dim < 0:
            continue
        sources = conv.source_patterns
        for i, src in enumerate(sources):
            pattern = re.compile(r"(?:^|\.)" + re.escape(src).replace(r"\*", r"(\d+)") + "$")
            rules.append(
                ExpertRule(pattern, conv.target_patterns[0], i, len(sources), dim, conv.scope_prefix)
            )
    return rules


def expert_rules(model: Any) -> list[ExpertRule]:
    """The rules transformers applies when loading ``model`` from a checkpoint; [] where it has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older transformers keeps experts unfused: names match one to one
        return []
    return rules_from_converters(get_model_conversion_mapping(model))


def fused_slot(name: str, rules: list[ExpertRule]) -> tuple[str, int, ExpertRule] | None:
    """(fused name, expert index, rule) for a per-expert ``name``; None when no rule matches."""
    for rule in rules:
        if rule.scope and not (name.startswith(rule.scope + ".") or f".{rule.scope}." in name):
            continue
        m = rule.source.search(name)
        if m:
            start = m.start() + (1 if m.group(0).startswith(".") else 0)
            return name[:start] + rule.target, int(m.group(1)), rule
    return None


def expert_view(fused: torch.Tensor, expert: int, rule: ExpertRule) -> torch.Tensor | None:
    """The view of ``fused`` one per-expert tensor fills; None if the expert or split does not fit."""
    if not 0 <= expert < fused.shape[0] or fused[expert].shape[rule.dim] % rule.parts:
        return None
    return fused[expert].chunk(rule.parts, dim=rule.dim)[rule.part]


def resolve(
    items: list[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor], rules: list[ExpertRule]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[str], list[str]]:
    """Each named tensor's destination in ``params`` (a parameter or an expert's slice of a fused one).

    Returns (destination, tensor) pairs, unknown names and shape mismatches (each naming the tensor);
    nothing is written.
    """
    pairs, unknown, bad = [], [], []
    for name, tensor in items:
        dest = params.get(name)
        if dest is None:
            slot = fused_slot(name, rules)
            fused = params.get(slot[0]) if slot else None
            if fused is None:
                unknown.append(name)
                continue
            dest = expert_view(fused, slot[1], slot[2])
            if dest is None:
                bad.append(f"{name}: expert {slot[1]} does not fit {slot[0]} {tuple(fused.shape)}")
                continue
        if tuple(tensor.shape) != tuple(dest.shape):
            bad.append(f"{name}: {tuple(tensor.shape)} != {tuple(dest.shape)}")
            continue
        pairs.append((dest, tensor))
    return pairs, sorted(unknown), bad
