"""``relax convert <checkpoint> <hf_dir>``: a trainer checkpoint -> a plain HF model directory.

Each backend whose checkpoints are not HF directories (sharded FSDP, megatron's dist checkpoints)
registers its format (``relax_register_checkpoint_formats``); the first whose ``detect`` recognises the
directory converts it, offline, in this process.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def convert(checkpoint: str, hf_dir: str) -> tuple[str, int]:
    """Convert ``checkpoint`` (a run's ``checkpoints/step_N`` or its ``trainer`` directory); the
    format's name and the number of tensors written."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"relax convert: {checkpoint} is not a directory")
    candidates = [path, path / "trainer"]
    for name in manager.names("checkpoint_format"):
        reg = manager.registration("checkpoint_format", name)
        for where in candidates:
            if reg.options["detect"](where):
                return name, int(reg.factory(str(where), hf_dir))
    raise ValueError(f"relax convert: no registered checkpoint format recognises {checkpoint} "
                     f"(registered: {manager.names('checkpoint_format')})")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a trainer checkpoint (<run_dir>/checkpoints/step_N, or its trainer/ directory)")
    parser.add_argument("hf_dir", help="where to write the HF model directory")


def cmd_convert(ns: argparse.Namespace) -> int:
    try:
        name, count = convert(ns.checkpoint, ns.hf_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(exc)
        return 2
    print(f"relax convert: wrote {count} tensors from a {name} checkpoint to {ns.hf_dir}")
    return 0
