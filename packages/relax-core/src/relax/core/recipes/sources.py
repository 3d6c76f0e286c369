"""A published dataset as it is distributed: a local directory or file (Parquet, JSON Lines, a JSON array,
a ``.tar.gz`` of them), or a Hub id (``datasets.load_dataset``, or the repository's files where the dataset
is a tarball of JSON and media). Rows come out one at a time with where they came from, so a converter can
name the file and row of every row it skips; a 1.8 M-row Parquet file is streamed, never loaded whole."""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceError(ValueError):
    """The source cannot be read at all (no such path, no data files, a file that is not what it claims)."""


@dataclass(frozen=True)
class SourceRow:
    """One published row: ``where`` is ``<file>:<row>`` (1-based), ``base`` the directory its relative media
    paths resolve against (None for Hub rows, whose media are inline)."""

    where: str
    row: dict[str, Any]
    base: Path | None


def is_hub_id(source: str) -> bool:
    """``owner/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(source)) and not Path(source).exists()


def data_files(root: Path, split: str, names: tuple[str, ...] = ()) -> list[Path]:
    """The data files of ``split`` under ``root`` (a file is itself): those whose name contains the split
    when any does (``train-00000-of-00001.parquet``), else every data file; ``names`` (exact file names)
    take precedence. Hidden directories (``.cache``, ``.git``) are not searched."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise SourceError(f"{root}: no such file or directory")
    found = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix in DATA_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if names:
        return [p for p in found if p.name in names]
    by_split = [p for p in found if split in p.stem]
    return by_split or found


def extract_archives(root: Path, into: Path) -> Path | None:
    """Unpack every ``.tar.gz`` / ``.tgz`` under ``root`` into ``into`` (once: a marker file records it);
    ``into`` when there was one, else None. Members that would land outside ``into`` are refused."""
    archives = sorted(p for p in root.rglob("*") if p.name.endswith((".tar.gz", ".tgz")) and p.is_file())
    if not archives:
        return None
    marker = into / ".relax-extracted"
    if not marker.exists():
        into.mkdir(parents=True, exist_ok=True)
        for archive in archives:
            with tarfile.open(archive) as tar:
                tar.extractall(into, filter="data")  # "data": no absolute paths, links or devices
        marker.write_text("\n".join(str(a) for a in archives) + "\n")
    return into


def iter_file(path: Path, base: Path) -> Iterator[SourceRow]:
    """Rows of one Parquet / JSON Lines / JSON-array file; a row that is not a JSON object comes out as
    ``{"__error__": why}`` so the converter counts it like any malformed row."""
    name = _display(path, base)
    if path.suffix == ".parquet":
        yield from _iter_parquet(path, name)
        return
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise SourceError(f"{path}: invalid JSON array: {e.msg} (line {e.lineno})") from None
        for n, row in enumerate(rows, start=1):
            yield SourceRow(
                f"{name}:{n}",
                row if isinstance(row, dict) else {"__error__": "not a JSON object"},
                path.parent,
            )
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            row = {"__error__": f"invalid JSON ({e.msg})"}
        yield SourceRow(
            f"{name}:{n}", row if isinstance(row, dict) else {"__error__": "not a JSON object"}, path.parent
        )


def _iter_parquet(path: Path, name: str) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise SourceError(f"{path}: cannot read Parquet file: {e}") from None
    n = 0
    for batch in reader.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield SourceRow(f"{name}:{n}", row, path.parent)


def iter_hub(hub_id: str, split: str) -> Iterator[SourceRow]:
    """Rows of a Hub dataset through ``datasets.load_dataset`` (downloads; needs network and ``datasets``)."""
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"reading {hub_id!r} from the Hub needs the `datasets` package (pip install datasets); "
            "or download it first and pass its directory to --source"
        ) from None
    try:
        ds = datasets.load_dataset(hub_id, split=split)
    except Exception as e:  # offline, no such repository, no such split: say what was tried
        raise SourceError(f"{hub_id!r} is no local path, and loading it from the Hub failed: {e}") from e
    for n, row in enumerate(ds, start=1):
        yield SourceRow(f"{hub_id}[{split}]:{n}", dict(row), None)


def hub_snapshot(hub_id: str) -> Path:
    """A local copy of a Hub dataset repository's files (``huggingface_hub.snapshot_download``)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SourceError(
            f"downloading {hub_id!r} needs huggingface_hub; or pass a local directory"
        ) from None
    try:
        return Path(snapshot_download(repo_id=hub_id, repo_type="dataset"))
    except Exception as e:  # offline, no such repository: say what was tried
        raise SourceError(f"{hub_id!r} is no local path, and downloading it from the Hub failed: {e}") from e


def _display(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix() if base.is_dir() else path.name
    except ValueError:
        return str(path)
