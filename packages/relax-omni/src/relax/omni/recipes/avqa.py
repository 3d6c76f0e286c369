"""AVQA-R1-6K (``harryhsing/AVQA-R1-6K``, EchoInk-R1's audio-image multiple-choice set from OmniInstruct-v1)
-> Relax rows for the ``multiple_choice`` reward.

Published layout: ``AVQA_R1.tar.gz`` unpacking to ``AVQA_R1/{train,valid}/`` with ``omni_rl_format_<split>.json``
(a JSON array: 4,490 train / 1,911 valid rows), ``images/`` and ``audios/``. A row: ``problem_id``, ``problem``
(the question), ``data_type`` ("image_audio"), ``problem_type`` ("multiple choice"), ``options``
(``["A. text", "B. text", ...]``), ``solution`` (``"<answer>B</answer>"``), ``path`` ``{image, audio}``
(relative to the split directory), ``data_source``. The archive is unpacked into ``<out>/.source`` once.

Relax row: ``{"messages": [{"role": "user", "content": [{"type": "image", ...}, {"type": "audio", ...},
{"type": "text", "text": question + lettered options + how to answer}]}], "label": "B", "options": {"A": text,
...}, "data_source"}``; ``multiple_choice`` reads the valid letters from ``metadata.options`` and the chosen one
from the last "Answer: X" (or a boxed letter, or the last standalone letter).
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax.core.recipes.fixtures import squares_png, tone_wav
from relax.core.recipes.output import Output, RowError
from relax.core.recipes.sources import (
    SourceError,
    SourceRow,
    data_files,
    extract_archives,
    hub_snapshot,
    is_hub_id,
    iter_file,
)

NAME = "avqa-r1-6k"
HUB_ID = "harryhsing/AVQA-R1-6K"
INSTRUCTION = 'Answer with the letter of the correct option on the last line, as "Answer: X".'
_OPTION = re.compile(r"^\s*\(?([A-Z])[.):]\s*(.*)$", re.DOTALL)
_ANSWER = re.compile(r"<answer>\s*\(?([A-Z])\b", re.IGNORECASE)


def read(source: str, split: str, out_dir: Path) -> Iterator[SourceRow]:
    """Rows of ``omni_rl_format_<split>.json`` under ``source`` (a directory, the archive's directory, or a
    Hub id whose files are downloaded first)."""
    root = hub_snapshot(source) if is_hub_id(source) else Path(source)
    names = (f"omni_rl_format_{split}.json",)
    files = data_files(root, split, names) if root.is_dir() else [root]
    if not files and root.is_dir() and (unpacked := extract_archives(root, out_dir / ".source")) is not None:
        files = data_files(unpacked, split, names)
    if not files:
        raise SourceError(
            f"{source}: no {names[0]} (nor a .tar.gz holding one); expected the AVQA_R1/{split}/ "
            "directory of the published dataset"
        )
    for file in files:
        yield from iter_file(file, file.parent)


def options_of(value: Any) -> dict[str, str]:
    """``["A. cat", "B. dog"]`` (or un-lettered texts, lettered in order) -> ``{"A": "cat", "B": "dog"}``."""
    if (
        not isinstance(value, list)
        or len(value) < 2
        or not all(isinstance(o, str) and o.strip() for o in value)
    ):
        raise RowError("options are not a list of at least two texts", f"got {value!r:.80}")
    parsed = [_OPTION.match(o) for o in value]
    if all(parsed):
        options = {m.group(1): m.group(2).strip() for m in parsed}
        if len(options) == len(value):
            return options
    return {chr(ord("A") + i): o.strip() for i, o in enumerate(value)}


def answer_letter(solution: Any, options: dict[str, str]) -> str:
    text = str(solution or "").strip()
    m = _ANSWER.search(text)
    letter = m.group(1).upper() if m else text.strip("()[]. ").upper()
    if letter not in options:
        by_text = [k for k, v in options.items() if v.lower() == text.lower()]
        if not by_text:
            raise RowError(
                "answer is not one of the options", f"solution {text!r:.40}, options {sorted(options)}"
            )
        letter = by_text[0]
    return letter


def prompt_text(problem: str, options: dict[str, str]) -> str:
    lines = [problem.strip(), "Options:", *(f"{k}. {v}" for k, v in options.items()), INSTRUCTION]
    return "\n".join(lines)


def convert(src: SourceRow, out: Output) -> tuple[dict[str, Any], str]:
    row, base = src.row, src.base or Path(".")
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise RowError("no problem text")
    options = options_of(row.get("options"))
    label = answer_letter(row.get("solution"), options)
    paths = row.get("path")
    if not isinstance(paths, dict) or not paths.get("image") or not paths.get("audio"):
        raise RowError("path has no image and audio", f"got {paths!r:.80}")
    image = out.media_file("image", base / paths["image"])
    audio = out.media_file("audio", base / paths["audio"])
    content = [
        {"type": "image", "image": image},
        {"type": "audio", "audio": audio},
        {"type": "text", "text": prompt_text(problem, options)},
    ]
    converted = {
        "messages": [{"role": "user", "content": content}],
        "label": label,
        "options": options,
        "data_source": row.get("data_source") or NAME,
    }
    return converted, json.dumps([image, audio, problem, options, label])


# --------------------------------------------------------------------------- fixture rows

_QUESTIONS = [
    ("What is making the sound?", ["dog", "piano", "car engine", "rain"]),
    ("Where does the video take place?", ["street", "kitchen", "forest", "beach"]),
    ("How many animals are there?", ["one", "two", "three", "four"]),
]


def fixture_rows(rows: int) -> list[dict[str, Any]]:
    """``rows`` good rows in the published JSON schema, then: an answer outside the options, a missing audio
    file, options that are not a list."""
    good = []
    for i in range(rows):
        question, texts = _QUESTIONS[i % len(_QUESTIONS)]
        correct = "ABCD"[i % 4]
        good.append(
            {
                "problem_id": i,
                "problem": question,
                "data_type": "image_audio",
                "problem_type": "multiple choice",
                "options": [f"{k}. {t}" for k, t in zip("ABCD", texts, strict=True)],
                "solution": f"<answer>{correct}</answer>",
                "path": {"image": f"images/sample_{i}.jpg", "audio": f"audios/sample_{i}.wav"},
                "data_source": "OmniInstruct_v1-AVQA",
            }
        )
    row = good[0]
    return [
        *good,
        {**row, "solution": "<answer>E</answer>"},
        {**row, "path": {"image": "images/sample_0.jpg", "audio": "audios/missing.wav"}},
        {**row, "options": "A. yes"},
    ]


def _jpeg(png: bytes) -> bytes:
    """The published images are JPEG; without Pillow the fixture keeps PNG (the converter sniffs either)."""
    try:
        import io

        from PIL import Image
    except ImportError:
        return png
    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


VALID_ROWS = 2  # the fixture's ``valid`` split: the recipe's held-out set


def _write_split(split_dir: Path, split: str, rows: list[dict[str, Any]]) -> None:
    (split_dir / "images").mkdir(parents=True, exist_ok=True)
    (split_dir / "audios").mkdir(exist_ok=True)
    for row in rows:
        i = row["problem_id"]
        if isinstance(i, int):
            (split_dir / "images" / f"sample_{i}.jpg").write_bytes(_jpeg(squares_png(i % 4 + 1)))
            (split_dir / "audios" / f"sample_{i}.wav").write_bytes(tone_wav(220.0 * (1 + i % 3)))
    (split_dir / f"omni_rl_format_{split}.json").write_text(json.dumps(rows, indent=1))


def write_fixture(directory: Path, rows: int, archive: bool = True) -> Path:
    """The published layout under ``directory``: ``AVQA_R1.tar.gz`` (or, ``archive=False``, the unpacked
    ``AVQA_R1/``) with ``train/`` (``rows`` rows and the malformed ones) and ``valid/`` (``VALID_ROWS`` other
    questions); returns ``directory``."""
    top = directory / ("staging" if archive else "") / "AVQA_R1"
    _write_split(top / "train", "train", fixture_rows(rows))
    valid = [
        {
            **r,
            "problem_id": 1000 + i,
            "problem": f"{r['problem']} (valid {i})",
            "path": {"image": f"images/sample_{1000 + i}.jpg", "audio": f"audios/sample_{1000 + i}.wav"},
        }
        for i, r in enumerate(fixture_rows(VALID_ROWS)[:VALID_ROWS])
    ]
    _write_split(top / "valid", "valid", valid)
    if archive:
        with tarfile.open(directory / "AVQA_R1.tar.gz", "w:gz") as tar:
            tar.add(top, arcname="AVQA_R1")
        shutil.rmtree(directory / "staging")
    return directory
