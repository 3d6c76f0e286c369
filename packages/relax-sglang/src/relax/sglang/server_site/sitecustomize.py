"""Runs at the start of every interpreter of a launched SGLang server (this directory leads its PYTHONPATH):
installs Relax's server patches, then runs the environment's own ``sitecustomize`` if it has one (ours
shadows it on the path)."""

import importlib
import os
import sys

import relax_sglang_server_patches

relax_sglang_server_patches.install()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours, saved = sys.modules.pop("sitecustomize", None), list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


_chain()
