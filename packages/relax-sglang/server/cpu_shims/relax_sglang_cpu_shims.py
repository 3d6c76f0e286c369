"""CPU shims for the SGLang server venv (copied into its site-packages by build_server_env.sh).

Loaded by ``relax_sglang_cpu_shims.pth`` at every interpreter start in that venv, so SGLang's scheduler and
detokenizer subprocesses get it too. Nothing here is imported by Relax itself.

Shim 1 -- torchvision operator schemas. Replaces: the ``torchvision::nms`` / ``torchvision::qnms`` schemas
that the CUDA-built PyPI torchvision 0.28 wheel registers from its C++ extension. Why: that extension does not
load beside CPU torch 2.13, and ``torchvision/_meta_registrations.py`` then dies at import ("operator
torchvision::nms does not exist"); SGLang and transformers import torchvision, so the server would not start.
Defining the two schemas before torchvision imports is enough (SGLang never calls nms on a text model).

Shim 2 -- ``sgl_kernel`` (the stub package next to this file). Replaces: the CUDA-only ``sglang-kernel``
wheel (no CPU wheel on PyPI). Why: SGLang imports it at module level; with ``SGLANG_USE_CPU_ENGINE=1`` and
the torch-native attention/sampling backends it falls back to pure torch and never calls a stub function --
each one raises NotImplementedError naming itself, so a path that does need a kernel fails loudly.

Shim 3 -- seeded sampling on CPU. Replaces: two GPU-only checks behind ``--enable-deterministic-inference``,
the only mode in which SGLang honours a request's ``sampling_seed`` (Relax's conformance contract: same seed,
same sample; the router resubmits lost requests with their seed). Why: that flag (a) refuses attention
backends outside a GPU list, so ``torch_native`` is added to it, and (b) registers batch-invariant matmul
kernels for CUDA/XPU/NPU only (it raises on CPU), so that step is skipped on a CPU model runner. The seeded
sampler itself (murmur-hash Gumbel noise per request and position) is plain torch and runs unchanged.

Shim 4 moved: the Qwen3-Omni audio fix is not CPU-specific, so it is one of Relax's server patches
(``relax/sglang/server_site``), which every launched server gets; ``after_import`` below comes from there
(build_server_env.sh copies that module in beside this one).
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list = []


def _define_torchvision_schemas() -> None:
    import torch

    lib = None
    for name, schema in _SCHEMAS.items():
        try:
            torch._C._get_schema(f"torchvision::{name}", "")
        except RuntimeError:
            lib = lib or torch.library.Library("torchvision", "FRAGMENT")
            lib.define(schema)
    if lib is not None:
        _LIBRARIES.append(lib)  # the schemas live as long as the Library object


class _BeforeTorchvision(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _define_torchvision_schemas()
        return None  # the regular finders import torchvision itself


def _allow_torch_native(choices) -> None:
    if "torch_native" not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.append("torch_native")


def _no_batch_invariant_kernels_on_cpu(model_runner) -> None:
    original = model_runner.ModelRunner.maybe_enable_batch_invariant_mode

    def maybe_enable_batch_invariant_mode(self):
        if str(getattr(self, "device", "")) != "cpu":
            original(self)

    model_runner.ModelRunner.maybe_enable_batch_invariant_mode = maybe_enable_batch_invariant_mode


def install() -> None:
    from relax_sglang_server_patches import after_import

    if "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _BeforeTorchvision())
    after_import("sglang.srt.arg_groups.choices", _allow_torch_native)
    after_import("sglang.srt.model_executor.model_runner", _no_batch_invariant_kernels_on_cpu)
