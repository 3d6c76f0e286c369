"""``relax data prepare``: a published dataset -> Relax JSONL + media, every skipped row counted by reason."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from relax.core.recipes.catalog import DatasetSpec, dataset_of
from relax.core.recipes.output import Output, PrepareReport, RowError

SMOKE_ROWS = 8
SMOKE_HELDOUT = 2  # held-out rows of a smoke dataset: its recipe's eval set


def default_out(spec: DatasetSpec, smoke: bool = False) -> Path:
    """``data/<dataset>`` (``data/<dataset>-smoke``), relative to the current directory: where the recipe
    configs look for it."""
    return Path("data") / (f"{spec.name}-smoke" if smoke else spec.name)


def prepare(
    name: str,
    source: str,
    out: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
    heldout: int = 0,
) -> PrepareReport:
    """Convert dataset (or recipe) ``name``'s ``split`` from ``source`` (a local path, or a Hub id) into
    ``out/<split>.jsonl``.

    Rows that cannot be converted are skipped and counted per reason (``PrepareReport.skipped``, with the
    first few places); ``limit`` stops after that many rows are converted; ``heldout`` of them go to
    ``out/heldout.jsonl`` instead (chosen by hash, see ``relax.core.recipes.output``). An unknown ``name`` is a
    ``KeyError`` naming the installed datasets and the packages that ship the seed ones."""
    spec = dataset_of(name)
    if heldout < 0:
        raise ValueError(f"heldout: must be >= 0, got {heldout}")
    out_dir = Path(out) if out is not None else default_out(spec)
    output = Output(out_dir, spec.name, source, split, heldout)
    try:
        for src in spec.read(source, split, out_dir):
            if limit is not None and output.added >= limit:
                break
            try:
                if "__error__" in src.row:
                    raise RowError("row is not a JSON object", src.row["__error__"])
                row, key = spec.convert(src, output)
            except RowError as error:
                output.skip(src.where, error)
                continue
            output.add(row, key)
    except BaseException:
        output.abandon()
        raise
    return output.finish()


def prepare_smoke(
    name: str, out: str | Path | None = None, rows: int = SMOKE_ROWS, heldout: int = 0
) -> PrepareReport:
    """Write ``rows`` fixture rows in the dataset's published layout (plus a few malformed ones) to
    ``<out>/source`` and convert them into ``out``: the converter's whole path, offline. ``heldout``: a
    held-out file as the recipe's eval set reads it -- the published held-out split where the dataset has one
    (``DatasetSpec.heldout_split``, whose fixture rows the layout holds), else ``heldout`` more rows carved out
    by ``--heldout``; the report is the training split's."""
    spec = dataset_of(name)
    out_dir = Path(out) if out is not None else default_out(spec, smoke=True)
    source = out_dir / "source"
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    carve = heldout if spec.heldout_split is None else 0
    spec.write_fixture(source, rows + carve)
    report = prepare(spec.name, str(source), out_dir, heldout=carve)
    if heldout and spec.heldout_split is not None:
        prepare(spec.name, str(source), out_dir, split=spec.heldout_split)
    return report


def build_smoke(name: str, root: Path, rows: int = SMOKE_ROWS) -> Path:
    """``root/<dataset>-smoke`` holding a prepared smoke dataset and its held-out file (``SMOKE_HELDOUT``
    rows), built once: in a temporary sibling renamed
    into place, so concurrent callers never see half of it. Returns the directory."""
    spec = dataset_of(name)
    target = root / f"{spec.name}-smoke-{rows}"
    if (target / "train.jsonl").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-build-", dir=root))
    try:
        prepare_smoke(spec.name, tmp, rows, SMOKE_HELDOUT)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "train.jsonl").exists():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
