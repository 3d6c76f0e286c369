"""Runs at the start of every interpreter of a launched SGLang server (this directory leads its PYTHONPATH):
checks that its SGLang is the release the patches were written for (else the interpreter stops here, at
start-up, naming both versions), installs Relax's server patches, then runs the environment's own
``sitecustomize`` if it has one (ours shadows it on the path)."""

import importlib
import os
import sys

import relax_sglang_server_patches
import relax_sglang_version_guard

try:
    relax_sglang_version_guard.check_patches(relax_sglang_version_guard.installed_sglang())
except relax_sglang_version_guard.SGLangVersionError as exc:
    raise SystemExit(f"relax.sglang: {exc}") from None

relax_sglang_server_patches.install()
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":  # a server on device cpu (relax.sglang.server.server_env)
    import relax_sglang_cpu_lora

    relax_sglang_cpu_lora.install()


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
