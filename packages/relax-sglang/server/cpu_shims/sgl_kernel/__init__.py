"""Stub for the CUDA-only ``sglang-kernel`` wheel (shim 2, see ``relax_sglang_cpu_shims.py``).

SGLang imports ``sgl_kernel`` (and a few submodules) at module level; on the CPU path
(``SGLANG_USE_CPU_ENGINE=1``, torch-native backends) no function of it is called. Any attribute or submodule
resolves to a callable that raises NotImplementedError naming what was needed.

One real op is provided: ``torch.ops.sgl_kernel.murmur_hash32_cpu``, which SGLang's seeded sampler
(``multinomial_with_seed``, used when a request carries ``sampling_seed``) calls on CPU. It is a pure-torch
port of SGLang's own Triton ``murmur_hash32_kernel`` (sglang/kernels/ops/sampling/murmur_hash.py): the same
MurmurHash3 mixing of (seed low, seed high, position, column), so samples depend only on seed and position.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+relax.cpu.stub"


class _Missing:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: sgl_kernel is a CPU stub (relax-sglang server venv)")

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self._name}.{item}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"sgl_kernel.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Missing(f"{self.__name__}.{item}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sgl_kernel.<anything>`` gives a stub module too."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


sys.meta_path.append(_SubmoduleFinder())

_M32 = 0xFFFFFFFF


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h, k):
    k = (k * 0xCC9E2D51) & _M32  # int64 products wrap mod 2**64; their low 32 bits are exact
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _murmur_hash32_cpu(seed, positions, col_indices):
    import torch

    seed = seed.to(torch.int64)[:, None]
    pos = (positions.to(torch.int64) & _M32)[:, None]
    col = (col_indices.to(torch.int64) & _M32)[None, :]
    h = _mix(torch.zeros_like(seed), seed & _M32)
    h = _mix(h, (seed >> 32) & _M32)
    h = _mix(h, pos)
    h = _mix(h.expand(-1, col.shape[1]), col)
    return _fmix(h ^ 16)


def _murmur_hash32_meta(seed, positions, col_indices):
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=__import__("torch").int64)


def _register_murmur_hash32_cpu() -> None:
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    lib.impl("murmur_hash32_cpu", _murmur_hash32_cpu, "CPU")
    lib.impl("murmur_hash32_cpu", _murmur_hash32_meta, "Meta")
    _LIBRARIES.append(lib)  # the op lives as long as the Library object


#: CPU ops that SGLang modules look up at import time (``torch.ops.sgl_kernel.<name>`` raises
#: AttributeError for an undefined op): qwen3_5.py binds them when ``_is_cpu``, and the Qwen-VL multimodal
#: processor imports qwen3_5, so without them no Qwen-VL/Omni model gets a processor ("No processor
#: registered"). The Qwen2.5/3-VL models never call them; a call fails naming the op (the stub schema takes no arguments).
_IMPORT_TIME_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


def _register_import_time_ops() -> None:
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in _IMPORT_TIME_OPS:
        lib.define(f"{name}(...) -> ...")
        lib.impl(name, _Missing(f"torch.ops.sgl_kernel.{name}"), "CompositeExplicitAutograd")
    _LIBRARIES.append(lib)


_LIBRARIES: list = []
_register_murmur_hash32_cpu()
_register_import_time_ops()
