"""Lets the PyPI torchvision 0.28 wheel import beside CPU torch 2.13 (loaded by ``_relax_torchvision_shim.pth``).

Why: the torchvision wheel on PyPI is built against CUDA torch; on the CPU torch build its C++ extension
does not register the ``torchvision::nms`` / ``torchvision::qnms`` operator schemas, and
``torchvision/_meta_registrations.py`` then fails at import ("operator torchvision::nms does not exist").
transformers imports torchvision whenever it is installed, so without this every model load breaks.

What: a ``sys.meta_path`` hook that, the first time ``torchvision`` is imported, defines the two missing
schemas (only if torch has not got them) and then steps aside. Nothing is imported at interpreter start-up
(torch is only touched when torchvision is). ``packages/relax-omni/tests/test_torchvision_shim.py`` proves it
still needed and still working, also in Ray workers; delete it when a CPU torchvision wheel matching core's
torch is used.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list = []  # keeps the torch.library.Library objects (and so the schemas) alive


def missing_schemas() -> list[str]:
    """The torchvision operator schemas torch does not know (empty when the shim is not needed)."""
    import torch

    return [name for name in _SCHEMAS if not _has_schema(torch, name)]


def _has_schema(torch, name: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


def define_missing_schemas() -> list[str]:
    """Define the schemas torch lacks; return their names."""
    import torch

    missing = missing_schemas()
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(_SCHEMAS[name])
        _LIBRARIES.append(lib)
    return missing


class _BeforeTorchvision(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_schemas()
        return None  # the regular finders import torchvision itself


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
