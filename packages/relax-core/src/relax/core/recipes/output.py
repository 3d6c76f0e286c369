"""Where a converted dataset goes: ``<out>/<split>.jsonl`` (Relax rows: ``train.jsonl``, ``valid.jsonl``, ...),
media files beside it (``images/``, ``audios/``, named by content hash, so a re-run or a duplicate image writes
nothing new), and ``<out>/prepare_report.json`` (``prepare_report.<split>.json`` for another split: rows
written, rows skipped per reason with the first few places).

A held-out split carved from the rows (``heldout``: ``relax data prepare --heldout N``) goes to
``<out>/heldout.jsonl``: the N rows whose dedup key hashes lowest, so the choice does not depend on the file's
order or on a seed, no row is in both files, and a re-run holds out the same rows. Only N rows are kept in
memory while the rest stream through (a training row may come up to N rows later than in the source).

The JSONL files are written to temporary names and renamed when complete: a run never reads half a dataset."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXAMPLES_PER_REASON = 3

# leading bytes -> file extension (enough to name a file and refuse bytes that are no image / audio)
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", ".png"),
    (b"\xff\xd8\xff", ".jpg"),
    (b"GIF87a", ".gif"),
    (b"GIF89a", ".gif"),
    (b"BM", ".bmp"),
)
_AUDIO_MAGIC = (
    (b"fLaC", ".flac"),
    (b"OggS", ".ogg"),
    (b"ID3", ".mp3"),
    (b"\xff\xfb", ".mp3"),
    (b"\xff\xf3", ".mp3"),
)


class RowError(ValueError):
    """A published row that cannot become a Relax row: ``reason`` is what is counted (one per kind of
    problem), ``detail`` what this row had."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def media_extension(data: bytes, kind: str) -> str | None:
    """The file extension ``data`` is in (``.png``, ``.wav``, ...), or None when it is no ``kind`` file."""
    if data[:4] == b"RIFF" and len(data) >= 12:
        return {
            b"WEBP": ".webp" if kind == "image" else None,
            b"WAVE": ".wav" if kind == "audio" else None,
        }.get(data[8:12])
    for magic, ext in _IMAGE_MAGIC if kind == "image" else _AUDIO_MAGIC:
        if data.startswith(magic):
            return ext
    return None


@dataclass
class PrepareReport:
    """What a conversion did; ``prepare_report.json`` holds the same."""

    dataset: str
    source: str
    path: str  # the JSONL written
    rows: int = 0
    heldout: int = 0  # rows written to ``heldout_path`` instead (``--heldout``)
    heldout_path: str | None = None
    duplicates: int = 0  # rows identical to an earlier one, dropped (DAPO-Math-17k repeats each problem)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first "<where>: <detail>"
    media: dict[str, int] = field(default_factory=dict)  # kind -> files written

    def summary(self) -> str:
        lines = [
            f"{self.dataset}: wrote {self.rows} rows to {self.path}"
            + (
                f" ({', '.join(f'{n} {k} files' for k, n in sorted(self.media.items()))})"
                if self.media
                else ""
            )
        ]
        if self.heldout_path is not None:
            lines.append(
                f"  held out {self.heldout} rows (never in {Path(self.path).name}) in {self.heldout_path}"
            )
        if self.duplicates:
            lines.append(f"  dropped {self.duplicates} duplicate rows")
        for reason, count in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"  skipped {count}: {reason} (e.g. {'; '.join(self.examples.get(reason, []))})")
        return "\n".join(lines)


class Output:
    """Collects converted rows and media for one output directory."""

    def __init__(
        self, out_dir: str | Path, dataset: str, source: str, split: str = "train", heldout: int = 0
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.split, self.heldout = split, heldout
        self.report = PrepareReport(dataset, source, str(self.dir / f"{split}.jsonl"))
        self._tmp = self.dir / f".{split}.jsonl.{os.getpid()}.tmp"
        self._fh = self._tmp.open("w", encoding="utf-8")
        self._held: list[tuple[int, int, str]] = []  # (-hash, order, line): a max-heap of the lowest hashes
        self.added = 0  # rows converted and kept, held out or not
        self._skipped: Counter[str] = Counter()
        self._media: Counter[str] = Counter()
        self._seen: set[str] = set()

    def media_bytes(self, kind: str, data: bytes, ext: str) -> str:
        """Store ``data`` as ``<kind>s/<sha256 prefix><ext>``; the path relative to the output directory."""
        rel = f"{kind}s/{hashlib.sha256(data).hexdigest()[:20]}{ext}"
        target = self.dir / rel
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
            self._media[kind] += 1
        return rel

    def media_file(self, kind: str, path: Path) -> str:
        """Copy a published media file in, refusing one whose bytes are no ``kind`` file."""
        if not path.is_file():
            raise RowError(f"{kind} file missing", str(path))
        data = path.read_bytes()
        ext = media_extension(data, kind)
        if ext is None:
            raise RowError(f"{kind} file is not a known {kind} format", path.name)
        return self.media_bytes(kind, data, ext)

    def add(self, row: dict[str, Any], key: str | None = None) -> bool:
        """Write ``row``; False (a counted duplicate) when an earlier row had the same ``key``."""
        if key is not None:
            digest = hashlib.sha256(key.encode()).hexdigest()
            if digest in self._seen:
                self.report.duplicates += 1
                return False
            self._seen.add(digest)
        line = json.dumps(row, ensure_ascii=False) + "\n"
        self.added += 1
        if self.heldout:
            rank = int.from_bytes(hashlib.sha256(f"heldout\0{key or line}".encode()).digest()[:8], "big")
            heapq.heappush(self._held, (-rank, self.added, line))
            if len(self._held) <= self.heldout:
                return True
            line = heapq.heappop(self._held)[2]  # the highest hash so far: a training row after all
        self._fh.write(line)
        self.report.rows += 1
        return True

    def skip(self, where: str, error: RowError) -> None:
        self._skipped[error.reason] += 1
        shown = self.report.examples.setdefault(error.reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(f"{where}: {error.detail}" if error.detail else where)

    def finish(self) -> PrepareReport:
        """Move the JSONL (and ``heldout.jsonl``) into place and write the report."""
        self._fh.close()
        if self.heldout:
            tmp = self.dir / f".heldout.jsonl.{os.getpid()}.tmp"
            tmp.write_text(
                "".join(line for _, _, line in sorted(self._held, key=lambda h: h[1])), encoding="utf-8"
            )
            os.replace(tmp, self.dir / "heldout.jsonl")
            self.report.heldout, self.report.heldout_path = len(self._held), str(self.dir / "heldout.jsonl")
        os.replace(self._tmp, self.dir / f"{self.split}.jsonl")
        self.report.skipped = dict(self._skipped)
        self.report.media = dict(self._media)
        (self.dir / report_name(self.split)).write_text(json.dumps(asdict(self.report), indent=2) + "\n")
        return self.report

    def abandon(self) -> None:
        self._fh.close()
        self._tmp.unlink(missing_ok=True)


def report_name(split: str) -> str:
    """``prepare_report.json`` for the training split, ``prepare_report.<split>.json`` for another."""
    return "prepare_report.json" if split == "train" else f"prepare_report.{split}.json"
