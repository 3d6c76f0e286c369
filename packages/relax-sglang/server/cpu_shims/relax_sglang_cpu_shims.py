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

Shim 4 -- Qwen3-Omni audio batches (an SGLang 0.5.23 bug, not CPU-specific). Replaces: nothing on CPU; it
pads before ``Qwen3OmniMoeThinkerForConditionalGeneration.get_audio_feature``. Why: that method concatenates
the audio items of every request in one prefill batch, but each request's features are padded only to its
own longest audio, so two concurrent audio prompts of different lengths crash the scheduler ("Sizes of
tensors must match ... Expected size 50 but got size 80"). Zero-padding features and feature masks to the
widest item is exact: the method keeps only the frames the masks select. GPU servers need the same fix.
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


def _pad_audio_batches(omni) -> None:
    import copy

    import torch.nn.functional as F

    cls = omni.Qwen3OmniMoeThinkerForConditionalGeneration
    original = cls.get_audio_feature

    def get_audio_feature(self, items):
        width = max(item.feature_attention_mask.shape[-1] for item in items)
        padded = []
        for item in items:
            extra = width - item.feature_attention_mask.shape[-1]
            if extra:
                item = copy.copy(item)  # the cached item keeps its own tensors
                item.feature = F.pad(item.feature, (0, extra))
                item.feature_attention_mask = F.pad(item.feature_attention_mask, (0, extra))
            padded.append(item)
        return original(self, padded)

    cls.get_audio_feature = get_audio_feature


_AFTER_IMPORT = {
    "sglang.srt.arg_groups.choices": _allow_torch_native,
    "sglang.srt.model_executor.model_runner": _no_batch_invariant_kernels_on_cpu,
    "sglang.srt.models.qwen3_omni_moe": _pad_audio_batches,
}


class _AfterImport(MetaPathFinder):
    """Runs a patch right after one of the ``_AFTER_IMPORT`` modules has executed."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _AFTER_IMPORT.pop(fullname, None)  # once: the regular finders below must not come back here
        if patch is None:
            return None
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "torchvision" not in sys.modules:
        sys.meta_path.insert(0, _BeforeTorchvision())
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
