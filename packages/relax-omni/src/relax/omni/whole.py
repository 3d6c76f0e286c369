"""A thinker saved from a whole Qwen-Omni checkpoint, written back into that checkpoint's layout.

Relax trains only the thinker of a whole Omni checkpoint (``adapters.WHOLE_OMNI``), so every trainer's
``save_hf`` and ``relax convert`` write a thinker directory. SGLang serves Qwen-Omni only whole, and a
user who downloaded the whole model expects the whole model back, talker and vocoder included.
:func:`rewrap_whole` turns the thinker directory into the source's layout in place: the thinker's weights
under ``thinker.``, every other weight of the source copied unchanged, the source's config (with the
thinker's dtype as saved) and any source file the directory lacks (e.g. Qwen2.5-Omni's ``spk_dict.pt``).
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

PREFIX = "thinker."
INDEX = "model.safetensors.index.json"
#: a thinker's weight names as transformers holds them in memory -> as its checkpoint names them (the megatron
#: trainer writes the former; transformers' ``save_pretrained`` the latter, already under ``thinker.``)
_CHECKPOINT_NAMES = (
    ("", ""),
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("model.audio_tower.", "audio_tower."),
)
_WRITTEN = {"config.json", INDEX}  # written here, not copied from the source
_THE_SOURCES = {"generation_config.json"}  # the whole model's, over the thinker's


def _source_files(source: Path) -> list[Path]:
    """The source's weight files (its index's, or every ``*.safetensors``)."""
    index = source / INDEX
    if index.is_file():
        return [source / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(source.glob("*.safetensors"))


def _whole_name(name: str, thinker_names: set[str], source: Path) -> str:
    """The whole checkpoint's name of the saved thinker weight ``name``: the one of ``thinker_names`` it is."""
    if name in thinker_names:
        return name
    for memory, checkpoint in _CHECKPOINT_NAMES:
        if (
            name.startswith(memory)
            and (whole := PREFIX + checkpoint + name.removeprefix(memory)) in thinker_names
        ):
            return whole
    raise ValueError(
        f"the saved thinker's weight {name!r} has no counterpart under {PREFIX!r} in the whole checkpoint "
        f"{source}: is it the checkpoint the run started from?"
    )


def _names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def _rest(source: Path) -> Iterator[tuple[str, dict]]:
    """``(file name, tensors)``: per source weight file, its weights outside the thinker (one file in memory)."""
    from safetensors import safe_open

    for file in _source_files(source):
        with safe_open(file, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(PREFIX)}  # noqa: SIM118
        if tensors:
            yield f"rest-{file.name}", tensors


def rewrap_whole(directory: str | Path, model_path: str | Path) -> bool:
    """Make ``directory`` (a thinker written by ``save_hf`` or ``relax convert``) the whole checkpoint
    ``model_path`` is. False, changing nothing, when it is not a thinker of it (already whole, or another model)."""
    from safetensors.torch import load_file, save_file

    out, source = Path(directory), Path(model_path)
    if not (out / "config.json").is_file():  # a LoRA adapter alone: PEFT applies it to the loaded thinker
        return False
    saved, whole = (json.loads((d / "config.json").read_text()) for d in (out, source))
    if "thinker_config" not in whole or saved.get("model_type") != whole["thinker_config"].get("model_type"):
        return False
    thinker_files = sorted(out.glob("*.safetensors"))
    thinker_names = {n for n in _names(_source_files(source)) if n.startswith(PREFIX)}
    renamed = {name: _whole_name(name, thinker_names, source) for name in _names(thinker_files)}
    if missing := thinker_names - set(renamed.values()):  # checked before a file changes
        raise ValueError(
            f"{out} lacks {len(missing)} of the thinker's weights in {source} (e.g. {min(missing)!r})"
        )
    weight_map: dict[str, str] = {}
    total = 0  # tensor bytes, as the index counts them
    shards = ((file.name, {renamed[n]: t for n, t in load_file(file).items()}) for file in thinker_files)
    for name, tensors in itertools.chain(
        shards, _rest(source)
    ):  # the thinker's renamed in place, then the rest
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    for key in ("dtype", "torch_dtype"):  # the thinker's weights are as trained; the rest keep the source's
        if key in saved:
            whole["thinker_config"][key] = saved[key]
    (out / "config.json").write_text(json.dumps(whole, indent=1))
    for file in source.iterdir():
        if file.suffix == ".safetensors" or file.name in _WRITTEN or not file.is_file():
            continue
        if file.name in _THE_SOURCES or not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    return True
