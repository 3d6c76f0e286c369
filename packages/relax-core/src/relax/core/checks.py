"""Launch checks: what would otherwise break a run after Ray has started, found before it starts.

``config_from_dict`` adds these to its own validation, so ``relax validate`` and ``relax run`` list
every problem in one message (exit 2). Three kinds:

* non-finite numbers anywhere -- a generic walk over every dataclass field, list and dict of the
  config, typed plugin sections included, so a new field is covered without a new rule;
* ranges the config's field-by-field checks do not cover (bucket sizes, concurrency, CPU counts...);
* paths (``check_paths``): data readable, model directory complete, ``run_dir`` writable. They touch
  the file system, so they run for the CLI and ``run()`` but not for configs built in tests.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: any of these next to config.json makes a directory loadable with AutoTokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer.tiktoken",
)
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_HF_DISK_MARKERS = ("state.json", "dataset_dict.json")


def nonfinite_errors(value: Any, path: str = "") -> list[str]:
    """Every NaN / inf float in a config tree (dataclasses, dicts, lists), named by dotted path."""
    return [
        f"{p}: must be a finite number, got {v!r}" for p, v in _numbers(value, path) if not math.isfinite(v)
    ]


#: field-name suffix -> (predicate, rule): ranges every such field obeys, in core's config and in
#: plugin sections alike (a new ``*_timeout_s`` field is checked without a new rule)
SUFFIX_RULES = {
    "timeout_s": (lambda v: v > 0, "> 0"),
    "bucket_mb": (lambda v: v > 0, "> 0"),
    "max_concurrency": (lambda v: v >= 1, ">= 1"),
    "num_cpus": (lambda v: v >= 0, ">= 0"),
    "num_gpus": (lambda v: v >= 0, ">= 0"),
}


def _numbers(value: Any, path: str) -> Iterator[tuple[str, float]]:
    """Every int / float leaf (not bool) of a config tree with its dotted path."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


def range_errors(cfg: Any) -> list[str]:
    """Ranges beyond ``config._semantic_errors``: sizes, concurrency, CPU counts, optimiser constants."""
    errors = []

    def need(ok: bool, path: str, rule: str, value: Any) -> None:
        if not ok:
            errors.append(f"{path}: must be {rule}, got {value!r}")

    for path, value in _numbers(cfg, ""):
        for suffix, (ok, rule) in SUFFIX_RULES.items():
            if path.rsplit(".", 1)[-1].endswith(suffix) and not path.startswith("ray."):
                need(ok(value), path, rule, value)
    t = cfg.trainer
    need(t.weight_decay >= 0, "trainer.weight_decay", ">= 0", t.weight_decay)
    need(t.eps > 0, "trainer.eps", "> 0", t.eps)
    for i, beta in enumerate(t.betas):
        need(0 <= beta < 1, f"trainer.betas[{i}]", "in [0, 1)", beta)
    if cfg.ray.num_cpus is not None:
        need(cfg.ray.num_cpus >= 1, "ray.num_cpus", ">= 1 or null", cfg.ray.num_cpus)
    if cfg.data.path is None:
        need(cfg.data.task_size >= 1, "data.task_size", ">= 1", cfg.data.task_size)
        need(cfg.data.task_max_operand >= 1, "data.task_max_operand", ">= 1", cfg.data.task_max_operand)
    return errors


# --------------------------------------------------------------------------- paths


def path_errors(cfg: Any) -> list[str]:
    """Data files readable, model directories complete, ``run_dir`` writable or creatable."""
    errors = []
    if cfg.data.path is not None:
        errors += data_path_errors("data.path", cfg.data.path)
    for name, eval_set in cfg.eval.sets.items():  # held-out sets: readable like the training data
        if eval_set.path is not None:
            errors += data_path_errors(f"eval.sets.{name}.path", eval_set.path)
    if cfg.model.path is not None:
        errors += model_dir_errors("model.path", cfg.model.path, tokenizer=True)
    a = cfg.algorithm
    if a.teacher_model_path not in (None, "policy_init") and Path(a.teacher_model_path).is_dir():
        errors += model_dir_errors("algorithm.teacher_model_path", a.teacher_model_path, tokenizer=False)
    if a.critic.enable and a.critic.model_path is not None and Path(a.critic.model_path).is_dir():
        errors += model_dir_errors("algorithm.critic.model_path", a.critic.model_path, tokenizer=False)
    errors += writable_dir_errors("run_dir", cfg.run_dir)
    return errors


def _unreadable(file: Path) -> str | None:
    try:
        with open(file, "rb") as fh:
            fh.read(1)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _missing(p: Path) -> str | None:
    """Why ``p`` cannot be looked at (does not exist, a parent is not searchable), or None."""
    try:
        p.stat()
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be accessed: {e.strerror}"
    return None


def data_path_errors(field: str, path: str) -> list[str]:
    p = Path(path)
    if why := _missing(p):
        return [f"{field}: {path!r} {why}"]
    if p.is_dir():
        if any((p / m).exists() for m in _HF_DISK_MARKERS):
            return []
        try:
            files = sorted(f for f in p.iterdir() if f.suffix in _DATA_SUFFIXES)
        except OSError as e:
            return [f"{field}: {path!r} cannot be listed: {e.strerror}"]
        if not files:
            return [f"{field}: directory {path!r} holds no .jsonl/.json/.parquet files"]
    else:
        files = [p]
    return [f"{field}: {str(f)!r} is not readable: {why}" for f in files if (why := _unreadable(f))]


def model_dir_errors(field: str, path: str, tokenizer: bool) -> list[str]:
    p = Path(path)
    if why := _missing(p):
        return [f"{field}: {path!r} {why} (HF-format model directory expected)"]
    if not p.is_dir():
        return [f"{field}: {path!r} is not a directory (HF-format model expected)"]
    errors = []
    if not (p / "config.json").is_file():
        errors.append(f"{field}: {path!r} has no config.json (HF-format model expected)")
    elif why := _unreadable(p / "config.json"):
        errors.append(f"{field}: {str(p / 'config.json')!r} is not readable: {why}")
    if tokenizer and not any((p / f).is_file() for f in TOKENIZER_FILES):
        errors.append(f"{field}: {path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    return errors


def writable_dir_errors(field: str, path: str) -> list[str]:
    """``path`` is a writable directory, or the nearest existing ancestor is one (so it can be created)."""
    p = Path(path).absolute()
    existing = next((a for a in (p, *p.parents) if os.path.lexists(a)), None)
    if existing is None:
        return [f"{field}: {path!r} has no existing ancestor directory"]
    if not existing.is_dir():
        return [f"{field}: {path!r} cannot be created: {str(existing)!r} is not a directory"]
    what = "is not writable" if existing == p else f"cannot be created: {str(existing)!r} is not writable"
    if _read_only_fs(existing):
        return [f"{field}: {path!r} {what} (read-only file system)"]
    if why := _write_probe_error(existing):
        return [f"{field}: {path!r} {what} ({why})"]
    return []


def _write_probe_error(directory: Path) -> str | None:
    """Why a file cannot be created in ``directory`` (None if it can): creates and removes one.

    ``os.access`` answers from the mode bits, and for root it says yes to directories such as
    ``/proc`` where every create fails; only trying tells."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".relax-write-check-", dir=directory)
    except OSError as e:
        return _WHY.get(e.errno, e.strerror or type(e).__name__)
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError as e:
        return f"a test file could not be removed: {e.strerror}"
    return None


_WHY = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "no file can be created there",
}


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# --------------------------------------------------------------------------- entry point


def launch_errors(cfg: Any, check_paths: bool = False, known: Iterable[str] = ()) -> list[str]:
    """Every launch problem in ``cfg`` not already reported in ``known`` (messages naming a field
    that ``known`` names are dropped, so ``top_p: nan`` is reported once)."""

    def field(msg: str) -> str:
        return msg.split(":", 1)[0]

    named = {field(msg) for msg in known}
    finite = [e for e in nonfinite_errors(cfg) if field(e) not in named]
    named |= {field(e) for e in finite}  # a NaN is not also reported as out of range
    others = range_errors(cfg) + (path_errors(cfg) if check_paths else [])
    return finite + [e for e in others if field(e) not in named]
