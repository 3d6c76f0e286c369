"""Adapter weight syncs on the HF engine: merge LoRA into the served weights once per version.

A LoRA trainer (``relax.core.trainers.lora``) sends ``<module>.lora_A.weight`` (``r x in``) and
``<module>.lora_B.weight`` (``out x r``, already scaled), named after the HF linear layer they adapt.
The engine keeps a pristine copy of each adapted weight the first time it sees its adapter and
serves ``W = W0 + B @ A`` (computed in fp32, cast to the weight's dtype): decoding then costs what
the base does, and a new version re-merges from ``W0`` (no drift from merging and unmerging).
Memory: one extra copy of the adapted weights only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

ADAPTER_PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B"}


def adapter_part(name: str) -> tuple[str, str] | None:
    """(module name, "A" | "B") for an adapter tensor's name; None for any other name."""
    for suffix, part in ADAPTER_PARTS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    return None


class AdapterMerger:
    """The adapters received so far and the pristine weights they merge into."""

    def __init__(self) -> None:
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": ..., "B": ...}
        self.pristine: dict[str, torch.Tensor] = {}  # "<module>.weight" -> the base weight

    def split(
        self, items: list[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]], list[str]]:
        """(plain items, adapter parts by module, shape errors). An adapter name whose module has no
        ``.weight`` in ``params`` stays a plain item (so it is reported as unknown). Nothing is stored."""
        plain, staged, bad = [], {}, []
        for name, tensor in items:
            part = adapter_part(name)
            weight = params.get(f"{part[0]}.weight") if part else None
            if weight is None or weight.dim() != 2:
                plain.append((name, tensor))
                continue
            module, which = part
            out_features, in_features = weight.shape
            ok = tensor.dim() == 2 and (
                tensor.shape[1] == in_features if which == "A" else tensor.shape[0] == out_features
            )
            if not ok:
                expected = f"(r, {in_features})" if which == "A" else f"({out_features}, r)"
                bad.append(
                    f"{name}: {tuple(tensor.shape)} does not fit {module}.weight {tuple(weight.shape)} "
                    f"(expected {expected})"
                )
                continue
            staged.setdefault(module, {})[which] = tensor
        for module, parts in staged.items():
            a = parts.get("A", self.adapters.get(module, {}).get("A"))
            b = parts.get("B", self.adapters.get(module, {}).get("B"))
            if a is not None and b is not None and a.shape[0] != b.shape[1]:
                bad.append(f"{module}: lora_A rank {a.shape[0]} != lora_B rank {b.shape[1]}")
        return plain, staged, bad

    def apply(self, staged: dict[str, dict[str, torch.Tensor]], params: Mapping[str, torch.Tensor]) -> None:
        """Keep the staged parts (copied: a transport may reuse its buffers) and re-merge every module
        that now has both; call under the engine's step lock, after ``split`` found no error."""
        for module, parts in staged.items():
            kept = self.adapters.setdefault(module, {})
            weight = params[f"{module}.weight"]
            for which, tensor in parts.items():
                kept[which] = tensor.detach().to(weight.device, torch.float32, copy=True)
            key = f"{module}.weight"
            if key not in self.pristine:
                self.pristine[key] = weight.detach().clone()
            if "A" in kept and "B" in kept:
                if weight.dtype == torch.float32:  # one pass, no temporary
                    torch.addmm(self.pristine[key], kept["B"], kept["A"], out=weight)
                else:
                    weight.copy_(torch.addmm(self.pristine[key].float(), kept["B"], kept["A"]))

    def to(self, device: torch.device | str) -> None:
        """Follow the weights (``release_memory`` / ``resume_memory``)."""
        self.pristine = {k: v.to(device) for k, v in self.pristine.items()}
        self.adapters = {m: {w: t.to(device) for w, t in parts.items()} for m, parts in self.adapters.items()}
