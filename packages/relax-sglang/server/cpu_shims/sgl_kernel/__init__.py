"""Stub for the CUDA-only ``sglang-kernel`` wheel (shim 2, see ``relax_sglang_cpu_shims.py``).

SGLang imports ``sgl_kernel`` (and a few submodules) at module level; on the CPU path
(``SGLANG_USE_CPU_ENGINE=1``, torch-native backends) no function of it is called. Any attribute or submodule
resolves to a callable that raises NotImplementedError naming what was needed.
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
