"""Adapter-only weight syncs into SGLang: ``trainer.lora`` served through SGLang's LoRA support.

The trainer exports ``<module>.lora_A.weight`` (``r x in``) and ``<module>.lora_B.weight`` (``out x r``,
already multiplied by ``alpha / rank``; docs/lora.md). The server is launched with ``--enable-lora`` for the
run's rank and target modules; each synced version is loaded whole (``/load_lora_adapter_from_tensors``,
named ``relax-lora-v<version>``), every later ``/generate`` names it (``lora_path``) and the previous
version is unloaded. The adapter config declares ``lora_alpha == r``, so SGLang scales by 1 and serves the
already-scaled ``lora_B`` as sent.
"""

from __future__ import annotations

from typing import Any

import torch

#: the target modules SGLang 0.5.23 can adapt on a dense decoder (``SUPPORTED_LORA_TARGET_MODULES``, the
#: names a Qwen/Llama-style HF model uses); ``all-linear`` maps onto SGLang's ``all``
TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."  # PEFT's names, which SGLang's adapter loader expects
PARTS = (".lora_A.weight", ".lora_B.weight")
#: the CPU-capable LoRA kernel backend (the others are Triton / Ascend kernels)
CPU_BACKEND = "torch_native"


def adapter_name(version: int) -> str:
    return f"relax-lora-v{version}"


def is_adapter_tensor(name: str) -> bool:
    return name.endswith(PARTS)


def validate(lora: Any, transport: str) -> list[str]:
    """What of ``trainer.lora`` (a ``LoraConfig``) this engine cannot serve, one message per field."""
    errors = []
    if lora.modules_to_save:
        errors.append(
            f"trainer.lora.modules_to_save: rollout.engine sglang serves adapters only (SGLang's LoRA "
            f"adapters carry no fully trained modules), got {list(lora.modules_to_save)}; use "
            "rollout.engine hf, or modules_to_save: []"
        )
    bad = [m for m in lora.target_modules if m not in (*TARGETS, ALL_LINEAR)]
    if bad:
        errors.append(
            f"trainer.lora.target_modules: SGLang cannot adapt {bad} (it adapts {list(TARGETS)} or "
            f"{ALL_LINEAR!r}); use rollout.engine hf for other modules"
        )
    if transport in ("sglang_disk", "sglang_distributed"):
        errors.append(
            f"weight_sync.transport: {transport} writes full weights into the server; an adapter sync "
            "needs sglang_tensor (or a core transport such as object_store)"
        )
    return errors


def server_args(lora: Any, device: str) -> list[str]:
    """``sglang.launch_server`` flags serving adapters of ``lora``'s rank and target modules."""
    targets = ["all"] if ALL_LINEAR in lora.target_modules else list(lora.target_modules)
    args = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets]
    if device == "cpu":
        args += ["--lora-backend", CPU_BACKEND]
    return args


def adapter_config(lora: Any) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` SGLang gets with each version: ``lora_alpha == r`` (scaling 1), since
    ``lora_B`` arrives scaled already."""
    targets = ALL_LINEAR if ALL_LINEAR in lora.target_modules else list(lora.target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.rank,
        "target_modules": targets,
        "bias": "none",
        "lora_dropout": 0.0,
    }


class PendingAdapter:
    """The adapter tensors of the version being synced (buckets arrive one by one; SGLang loads an adapter
    whole), copied: a transport may reuse its buffers."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, items: list[tuple[str, torch.Tensor]], engine: str) -> None:
        plain = [n for n, _ in items if not is_adapter_tensor(n)]
        if plain:
            raise ValueError(
                f"{engine} serves LoRA adapters (trainer.lora): got non-adapter tensors {plain[:4]} "
                f"({len(plain)} in all)"
            )
        for name, tensor in items:
            self.tensors[PEFT_PREFIX + name] = tensor.detach().to("cpu", copy=True).contiguous()

    def take(self) -> dict[str, torch.Tensor]:
        """The complete adapter (every lora_A with its lora_B), emptying the stage."""
        tensors, self.tensors = self.tensors, {}
        modules = {n.removesuffix(p) for n in tensors for p in PARTS if n.endswith(p)}
        unpaired = sorted(m for m in modules if any(m + p not in tensors for p in PARTS))
        if unpaired:
            raise ValueError(f"adapter sync incomplete: {unpaired[:4]} miss lora_A or lora_B")
        return tensors

    def __bool__(self) -> bool:
        return bool(self.tensors)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
