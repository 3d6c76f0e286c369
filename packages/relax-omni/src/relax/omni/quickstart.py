"""The omni quick-starts' inputs, built on first use (``inputs.name``: ``omni_vl_quickstart`` / ``_audio_``).

Each is a tiny model built locally from a config (no hub) plus a generated media task that such a model learns
to read within a minute or two of CPU GRPO (``relax.omni.synthetic``): the VL one says which colour a shape is
and whether a video gets darker or lighter; the audio one says whether a tone is low, middle or high and which
colour a shape is. A policy that ignores the media stays at chance (1/3 per 3-way question, 1/2 for the fade),
so a reward near 1 means it reads them.

The model is warmed up on the answer *format* only, as an instruction-tuned model would come: 40 supervised
steps on a separate small set of the tasks' prompts, media included, each answered by a random option. It
starts answering with an option at chance; what GRPO adds is reading the media. (Without the warm-up the first
~10 steps go to finding the digits and some seeds stay below 0.6 in 30 steps; warmed up on the questions as
text only, the media shift the first answers onto one option and some seeds learn a colour late.)

Both are cached like core's quick-start model: under ``$RELAX_CACHE_DIR`` (else ``~/.cache/relax``) in a
directory named by a fingerprint of the recipe, built in a temporary sibling and renamed into place, so a
second run (or a concurrent one) reuses it and a changed recipe never reads a stale build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.omni.synthetic import OPTIONS, QUESTIONS

_FORMAT = 1  # bump when the build recipe changes (the fingerprint then names a new directory)
PREPARE = "python examples/omni/prepare.py"  # builds the same inputs ahead of a run (e.g. for a shared cache)
BUILT = ("model/config.json", "model/model.safetensors", "model/tokenizer.json", "data/train.jsonl")


@dataclass(frozen=True)
class Quickstart:
    family: str  # tiny model family (relax.omni.tiny_models)
    tasks: tuple[str, ...]  # relax.omni.synthetic tasks, cycled row by row


QUICKSTARTS = {
    "omni_vl_quickstart": Quickstart("qwen2_5_vl", ("colour", "fade")),
    "omni_audio_quickstart": Quickstart("qwen2_5_omni", ("pitch", "colour")),
}

# the examples' data.processor_params: the warm-up processes its media as the runs do (a test keeps them equal)
BUDGETS = {
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "video_min_pixels": 28 * 28,
    "video_max_pixels": 56 * 56,
    "fps": 2.0,
    "max_frames": 4,
}
WARMUP = {"rows": 24, "steps": 40, "batch": 8, "lr": 3e-3, "seed": 7}  # format warm-up: ~5 s on one core
# One weight scale for every tower and head. The Omni thinker's own default (0.02 at its top level, while its
# text config says 0.3) leaves the LM head near zero: the first policy is uniform over the vocabulary
# (entropy 4.2 of ln 77 = 4.34); 40 GRPO steps of 8 prompts then peaked at reward 0.19, against 0.53 at 0.3.
INITIALIZER_RANGE = 0.3


@dataclass(frozen=True)
class OmniQuickstartParams:
    """``inputs.params`` of the omni quick-starts."""

    rows: int = 192  # dataset rows (the runs draw 16 a step: a 40-step run sees each about 3 times)
    seed: int = 0  # the dataset's seed (the model is always the same seeded build)
    cache_dir: str | None = None  # default: $RELAX_CACHE_DIR, else ~/.cache/relax


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir``, else ``$RELAX_CACHE_DIR``, else ``~/.cache/relax`` (core's quick-start model's root)."""
    return Path(cache_dir or os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")


def fingerprint(quickstart: Quickstart, rows: int, seed: int) -> str:
    """Short hash of everything that determines the built files."""
    from relax.omni import tiny_models as mm

    recipe = {
        "format": _FORMAT,
        "family": quickstart.family,
        "tasks": quickstart.tasks,
        "rows": rows,
        "seed": seed,
        "text": mm.TEXT,
        "init": INITIALIZER_RANGE,
        "model_seed": mm.MODEL_SEED,
        "model_format": mm.BUILD_FORMAT,
        "warmup": WARMUP,
        "budgets": BUDGETS,
        "questions": [QUESTIONS[t] for t in quickstart.tasks],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def warm_up_format(
    model_dir: str | os.PathLike[str], family: str, tasks: tuple[str, ...], scratch: Path
) -> None:
    """Supervised steps on a separate small set of the tasks' prompts, media included (processed as a run
    processes them), each answered by an option drawn at random then the end of turn (loss on the answer):
    the answer format, with nothing that relates an answer to what the media show. Saves the weights back."""
    import random

    import torch
    from transformers import AutoTokenizer

    from relax.core.context import PluginContext
    from relax.omni.adapters import QwenMediaAdapter
    from relax.omni.processors import OmniProcessorParams, make_factory
    from relax.omni.synthetic import make_dataset

    data = make_dataset(scratch, tasks, WARMUP["rows"], seed=WARMUP["seed"])
    processor = make_factory(family)(
        OmniProcessorParams(**BUDGETS, media_root=str(scratch)),
        PluginContext(role="processor", model_path=str(model_dir)),
    )
    rows = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    pool = [
        (processor.process(row, [], f"warm-up:{i}"), OPTIONS[tasks[i % len(tasks)]])
        for i, row in enumerate(rows)
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = QwenMediaAdapter()  # as core's trainer runs these models (audio encoded item by item)
    model = adapter.load(str(model_dir), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP["lr"])
    rng = random.Random(WARMUP["seed"])
    model.train()
    for _ in range(WARMUP["steps"]):
        for _ in range(WARMUP["batch"]):
            prompt, options = pool[rng.randrange(len(pool))]
            ids = list(prompt["prompt_ids"])
            answer = tokenizer.encode(
                f"{rng.randint(1, options)}{tokenizer.eos_token}", add_special_tokens=False
            )
            row = torch.tensor([ids + answer])
            labels = torch.tensor([[-100] * len(ids) + answer])
            kwargs = adapter.forward_kwargs(model, row, torch.ones_like(row), prompt["inputs"], len(ids))
            (model(**kwargs, labels=labels).loss / WARMUP["batch"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir, safe_serialization=True)


def build_model(directory: str | os.PathLike[str], family: str) -> str:
    """The seeded tiny ``family`` model, tokenizer and processor (``tiny_models``' recipe, one init scale)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from relax.omni import tiny_models as mm

    out = Path(directory)
    tokenizer = mm.build_tokenizer(family)
    config = mm.build_config(family, tokenizer)
    config.initializer_range = INITIALIZER_RANGE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mm.MODEL_SEED)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # as tiny_models does: fresh norms are all ones
            p.data.add_(0.02 * torch.randn_like(p))
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    mm.build_processor(family, tokenizer).save_pretrained(out)
    return str(out)


def _build(tmp: Path, target: Path, quickstart: Quickstart, rows: int, seed: int) -> None:
    """Build into ``tmp``; the rows name their media where they will be once ``tmp`` is renamed to ``target``."""
    from relax.omni.synthetic import make_dataset

    build_model(tmp / "model", quickstart.family)
    warm_up_format(tmp / "model", quickstart.family, quickstart.tasks, tmp / "warm-up")
    shutil.rmtree(tmp / "warm-up")
    make_dataset(tmp / "data", quickstart.tasks, rows, seed=seed, media_dir=target.resolve() / "data")


def _check_complete(name: str, target: Path) -> None:
    missing = [part for part in BUILT if not (target / part).exists()]
    if missing:
        raise FileNotFoundError(
            f"inputs {name!r}: {target} lacks {', '.join(missing)}; remove that directory and run again "
            "(the inputs are rebuilt on first use)"
        )


def ensure_quickstart(
    name: str, rows: int = 192, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """``{"model.path": ..., "data.path": ...}`` of quick-start ``name``, built on first use.

    The data rows name their media by absolute path (a cache directory is this machine's), so the config
    needs no ``media_root`` and a user's own ``data.path`` keeps resolving its relative media as documented.
    """
    if name not in QUICKSTARTS:
        raise ValueError(f"unknown omni quick-start {name!r}; choose one of {sorted(QUICKSTARTS)}")
    quickstart = QUICKSTARTS[name]
    root = cache_root(cache_dir)
    target = root / f"{name.replace('_', '-')}-{fingerprint(quickstart, rows, seed)}"
    paths = {"model.path": str(target / "model"), "data.path": str(target / "data" / "train.jsonl")}
    if target.exists():  # only ever renamed into place complete: what lacks a part was damaged afterwards
        _check_complete(name, target)
        return paths
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=root))
    except OSError as exc:
        raise OSError(
            f"inputs {name!r}: cannot build under {root} ({exc.strerror or exc}); set RELAX_CACHE_DIR "
            f"(or inputs.params.cache_dir) to a writable directory, or build elsewhere with "
            f"`{PREPARE} --cache-dir DIR`"
        ) from exc
    try:
        _build(tmp, target, quickstart, rows, seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():  # not a lost race: a real error
                raise
            _check_complete(name, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def make_factory(name: str) -> Any:
    def factory(params: OmniQuickstartParams, ctx: Any) -> dict[str, str]:
        return ensure_quickstart(name, params.rows, params.seed, params.cache_dir)

    return factory


def register_inputs(register: Any) -> None:
    for name in QUICKSTARTS:
        register(name, make_factory(name), config=OmniQuickstartParams, fills=("model.path", "data.path"))
