"""LoRA serving on a CPU server: SGLang 0.5.23's LoRA host buffers unpinned (installed by ``sitecustomize``
in a server launched on device ``cpu``, i.e. with ``SGLANG_USE_CPU_ENGINE=1``).

Replaces: the ``pin_memory`` requests of SGLang's LoRA layers, memory pool and ``torch_native`` LoRA backend
(``torch.tensor(..., pin_memory=True)``, ``torch.zeros(..., pin_memory=True)``, ``tensor.pin_memory()``).
Why: a CPU-only torch has no pinned-memory allocator, so ``--enable-lora`` dies at start-up ("pin_memory=True
requires a CUDA or other accelerator backend", ``sglang/srt/lora/layers.py`` ``ColumnParallelLinearWithLoRA``)
and every LoRA batch would die the same way in ``torch_backend.prepare_lora_batch``. On a machine without
an accelerator pinning only ever raises, so the patch turns exactly those errors into plain host tensors;
where torch can pin (a CUDA build) nothing is patched.

Kept apart from ``relax_sglang_server_patches`` (which the CPU venv's hash covers) so the venv is not
rebuilt for it; it must not import Relax either: it runs in the server's environment.
"""

from __future__ import annotations

from typing import Any

#: the LoRA modules that ask for pinned host tensors through ``torch.<factory>(..., pin_memory=True)``
LORA_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.mem_pool", "sglang.srt.lora.backend.torch_backend")


class _TorchWithoutPinning:
    """``torch`` as seen by one LoRA module: its tensor factories ignore ``pin_memory``; all else is torch."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        for name in ("tensor", "empty", "zeros", "ones", "arange", "full"):
            setattr(self, name, self._unpinned(getattr(torch, name)))

    @staticmethod
    def _unpinned(factory: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _unpin_module(module: Any) -> None:
    torch = module.torch
    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # without an accelerator it only ever raises
    module.torch = _TorchWithoutPinning(torch)


def install() -> None:
    """Idempotent; each LoRA module is patched when first imported (torch is loaded by then)."""
    if getattr(install, "done", False):
        return
    install.done = True
    from relax_sglang_server_patches import after_import

    for name in LORA_MODULES:
        after_import(name, _unpin_module)
