"""A trainer's export in the layout the served model's loader takes.

A family served whole (its adapter's ``ServingConventions.served_prefix``: the served checkpoint wraps the
model the trainers train) has a loader that takes the checkpoint's names under that prefix and the
checkpoint's per-expert layout, and skips a name it does not hold (a log line in the server, nothing in the
reply). Relax's trainers export the model as transformers holds it in memory (each layer's experts fused into
``gate_up_proj`` / ``down_proj``). So the ``sglang_*`` transports map every bucket on the trainer's side,
after asking the engines what their servers run (the distributed transport broadcasts tensors the server takes
as they come, so the mapping cannot wait for the engine's process), and the engine refuses names its server's
loader would skip.

A served model type whose adapter declares no prefix takes the export as it is (SGLang's loaders map
transformers' in-memory names themselves).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax.core.model_family import serving_conventions

NamedTensors = list[tuple[str, torch.Tensor]]

FUSED_GATE_UP = ".mlp.experts.gate_up_proj"  # [experts, 2 x intermediate, hidden]: gate rows, then up rows
FUSED_DOWN = ".mlp.experts.down_proj"  # [experts, hidden, intermediate]


@dataclass(frozen=True)
class ServedLayout:
    """How one served architecture names the weights a trainer exports."""

    prefix: str  # on every name its loader takes
    renames: tuple[tuple[str, str], ...]  # exported name prefix -> checkpoint name prefix (under ``prefix``)

    def map_bucket(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
        """``bucket`` under checkpoint names, fused experts split per expert; names already under ``prefix``
        pass as they are. An exported name no rename covers is an error, not a skip."""
        out: NamedTensors = []
        for name, tensor in bucket:
            if name.startswith(self.prefix):
                out.append((name, tensor))
                continue
            served = self.prefix + self._rename(name)
            if served.endswith(FUSED_GATE_UP):
                base, half = served.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
                for e, expert in enumerate(tensor):
                    out += [
                        (f"{base}.{e}.gate_proj.weight", expert[:half]),
                        (f"{base}.{e}.up_proj.weight", expert[half:]),
                    ]
            elif served.endswith(FUSED_DOWN):
                base = served.removesuffix(".down_proj")
                out += [(f"{base}.{e}.down_proj.weight", expert) for e, expert in enumerate(tensor)]
            else:
                out.append((served, tensor))
        return out

    def _rename(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name.removeprefix(old)
        raise ValueError(
            f"weight {name!r} is not one the served model's loader takes under {self.prefix!r} "
            f"(known prefixes: {', '.join(old for old, _ in self.renames)})"
        )


def layout_for(served: str) -> ServedLayout:
    """The layout of a served model type (what :func:`served_architecture` returned), from its family's adapter."""
    conventions = serving_conventions(served)
    if not conventions.served_prefix:
        raise ValueError(
            f"model_type {served!r}: its model adapter declares no served layout (ServingConventions)"
        )
    return ServedLayout(prefix=conventions.served_prefix, renames=conventions.served_renames)


def served_architecture(model_path: str) -> str | None:
    """The model type a server launched from ``model_path`` runs, if its family declares a served layout
    (None for the others, and for a path that is not a local checkpoint directory)."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if serving_conventions(model_type).served_prefix else None


def check_served_names(names: Iterable[str], architecture: str | None, engine: str) -> None:
    """Raise ``ValueError`` when ``names`` are not all under the served ``architecture``'s prefix (its loader
    would skip the others)."""
    if architecture is None:
        return
    prefix = layout_for(architecture).prefix
    stray = next((n for n in names if not n.startswith(prefix)), None)
    if stray is not None:
        raise ValueError(
            f"{engine}: the server runs {architecture}, whose loader takes checkpoint names under "
            f"{prefix!r} (got {stray!r}); the sglang_* transports map a trainer's export, "
            "relax.sglang.served_layout.layout_for does it for a direct call"
        )


def safetensors_names(path: str) -> Iterator[str]:
    """The tensor names of every ``*.safetensors`` file in the directory ``path`` (headers only)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            yield from f.keys()


class ServedExport:
    """``trainer`` whose ``export_weights`` yields buckets in ``layout`` (the trainer itself for None)."""

    def __init__(self, trainer: Any, layout: ServedLayout | None):
        self.trainer, self.layout = trainer, layout

    def export_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        for bucket in self.trainer.export_weights(bucket_bytes):
            yield bucket if self.layout is None else self.layout.map_bucket(bucket)
