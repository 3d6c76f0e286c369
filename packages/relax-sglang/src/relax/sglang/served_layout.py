"""A trainer's export in the layout the served model's loader takes.

SGLang serves Qwen3-Omni whole (``Qwen3OmniMoeForConditionalGeneration``): its ``load_weights`` takes the
checkpoint's names under ``thinker.`` and the checkpoint's per-expert layout, and skips a name it does not hold
(a log line in the server, nothing in the reply). Relax's trainers export the thinker as transformers holds it in
memory (``model.language_model.*``, ``model.audio_tower.*``, each layer's experts fused into ``gate_up_proj`` /
``down_proj``). So the ``sglang_*`` transports map every bucket on the trainer's side, after asking the engines
what their servers run (the distributed transport broadcasts tensors the server takes as they come, so the
mapping cannot wait for the engine's process), and the engine refuses names its server's loader would skip.

A served architecture not in :data:`LAYOUTS` takes the export as it is (Qwen3, Qwen2.5-VL, Qwen3-VL: SGLang's
loaders map transformers' in-memory names themselves).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
                    out += [(f"{base}.{e}.gate_proj.weight", expert[:half]), (f"{base}.{e}.up_proj.weight", expert[half:])]
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
        raise ValueError(f"weight {name!r} is not one the served model's loader takes under {self.prefix!r} "
                         f"(known prefixes: {', '.join(old for old, _ in self.renames)})")


#: served architecture -> its layout (Qwen3-Omni's thinker as transformers' checkpoint conversion writes it)
LAYOUTS = {
    "Qwen3OmniMoeForConditionalGeneration": ServedLayout(
        prefix="thinker.",
        renames=(("model.language_model.", "model."), ("model.visual.", "visual."),
                 ("model.audio_tower.", "audio_tower."), ("lm_head.", "lm_head.")),
    ),
}


def served_architecture(model_path: str) -> str | None:
    """The architecture a server launched from ``model_path`` runs, if :data:`LAYOUTS` has it (None for the
    others, and for a path that is not a local checkpoint directory)."""
    try:
        architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return next((a for a in architectures if a in LAYOUTS), None)


def check_served_names(names: Iterable[str], architecture: str | None, engine: str) -> None:
    """Raise ``ValueError`` when ``names`` are not all under the served ``architecture``'s prefix (its loader
    would skip the others)."""
    if architecture is None:
        return
    prefix = LAYOUTS[architecture].prefix
    stray = next((n for n in names if not n.startswith(prefix)), None)
    if stray is not None:
        raise ValueError(f"{engine}: the server runs {architecture}, whose loader takes checkpoint names under "
                         f"{prefix!r} (got {stray!r}); the sglang_* transports map a trainer's export, "
                         "relax.sglang.served_layout.LAYOUTS does it for a direct call")


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
