"""``relax convert <checkpoint> <hf_dir>``: a trainer checkpoint -> a plain HF model directory.

Each backend whose checkpoints are not HF directories (sharded FSDP, megatron's dist checkpoints)
registers its format (``relax_register_checkpoint_formats``); the first whose ``detect`` recognises the
directory converts it, offline, in this process. The result is then put back into the layout of the model
the run started from (recorded in the checkpoint, or ``--model``): a whole Qwen-Omni checkpoint, of which
the run trained the thinker, comes back whole (``relax.core.multimodal_model.restore_layout``).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path


def _started_from(path: Path) -> str | None:
    """The model path the checkpoint's run started from (``controller.json``; None before it was recorded)."""
    from relax.core.checkpoint import CONTROLLER_STATE, read_controller_state

    for where in (path, path.parent):
        if (where / CONTROLLER_STATE).is_file():
            return read_controller_state(where).get("model_path")
    return None


def _restore(hf_dir: str, source: str | None) -> None:
    from relax.core.multimodal_model import restore_layout

    if source is not None and Path(source).is_dir():
        restore_layout(hf_dir, source)
    elif source is not None:
        warnings.warn(
            f"relax convert: the run's model {source} is gone: {hf_dir} holds the trained model as loaded "
            "(where its model adapter loaded part of a checkpoint, that part alone); --model names where it is now",
            stacklevel=3,
        )


def convert(checkpoint: str, hf_dir: str, model_path: str | None = None) -> tuple[str, int]:
    """Convert ``checkpoint`` (a run's ``checkpoints/step_N`` or its ``trainer`` directory); the
    format's name and the number of tensors the format wrote. ``model_path``: the model the run
    started from, when not the one the checkpoint records."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    path = Path(checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(f"relax convert: {checkpoint} is not a directory")
    if model_path is not None and not Path(model_path).is_dir():
        raise FileNotFoundError(f"relax convert: --model {model_path} is not a directory")
    candidates = [path, path / "trainer"]
    for name in manager.names("checkpoint_format"):
        reg = manager.registration("checkpoint_format", name)
        for where in candidates:
            if reg.options["detect"](where):
                count = int(reg.factory(str(where), hf_dir))
                _restore(hf_dir, model_path or _started_from(path))
                return name, count
    raise ValueError(
        f"relax convert: no registered checkpoint format recognises {checkpoint} "
        f"(registered: {manager.names('checkpoint_format')})"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a trainer checkpoint (<run_dir>/checkpoints/step_N, or its trainer/ directory)"
    )
    parser.add_argument("hf_dir", help="where to write the HF model directory")
    parser.add_argument(
        "--model",
        default=None,
        help="the model the run started from, if moved since (default: the "
        "path the checkpoint records; what was trained is written back into its layout)",
    )


def cmd_convert(ns: argparse.Namespace) -> int:
    try:
        name, count = convert(ns.checkpoint, ns.hf_dir, ns.model)
    except (FileNotFoundError, ValueError) as exc:
        print(exc)
        return 2
    print(f"relax convert: wrote {count} tensors from a {name} checkpoint to {ns.hf_dir}")
    return 0
