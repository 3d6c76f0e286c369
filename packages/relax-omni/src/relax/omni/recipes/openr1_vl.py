"""multimodal-open-r1-8k-verified (``lmms-lab/multimodal-open-r1-8k-verified``) -> Relax rows for the
``openr1_mm`` reward.

Published schema (``data/train-00000-of-00001.parquet``, ~7.7k rows): ``image`` (an HF ``Image``: in the
Parquet file a struct ``{bytes, path}``; from ``datasets`` a decoded PIL image), ``problem`` (the question),
``solution`` (the reference answer, usually wrapped in ``<answer>...</answer>``), ``original_question``,
``original_answer``.

Relax row: ``{"messages": [{"role": "user", "content": [{"type": "image", "image": "images/<hash>.png"},
{"type": "text", "text": problem}]}], "label": solution, "data_source"}`` with the image extracted to a file
beside the JSONL (the config's ``data.processor_params.media_root`` is the output directory). ``openr1_mm``
scores the ``<answer>`` content (math-verify, then the option letter, then normalised text) plus the
``<think>...</think><answer>...</answer>`` format the recipe's system prompt asks for.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from relax.core.recipes.fixtures import squares_png
from relax.core.recipes.output import Output, RowError, media_extension
from relax.core.recipes.sources import SourceRow

NAME = "multimodal-open-r1-8k-verified"
HUB_ID = "lmms-lab/multimodal-open-r1-8k-verified"


def image_bytes(value: Any, base: Path | None) -> bytes:
    """The encoded image of an HF ``Image`` cell: ``{bytes, path}`` (Parquet), a PIL image (``datasets``),
    or raw bytes."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path") and base is not None and (base / value["path"]).is_file():
            return (base / value["path"]).read_bytes()
        raise RowError("image is empty", f"path {value.get('path')!r} and no bytes")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if hasattr(value, "save"):  # a PIL image: keep its own format (JPEG stays JPEG)
        buf = io.BytesIO()
        value.save(buf, format=getattr(value, "format", None) or "PNG")
        return buf.getvalue()
    raise RowError("image is missing", f"got {type(value).__name__}")


def convert(src: SourceRow, out: Output) -> tuple[dict[str, Any], str]:
    row = src.row
    problem = row.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise RowError("no problem text")
    solution = row.get("solution")
    if solution is None or not str(solution).strip():
        raise RowError("no solution")
    data = image_bytes(row.get("image"), src.base)
    ext = media_extension(data, "image")
    if ext is None:
        raise RowError("image is not a PNG/JPEG/GIF/WEBP/BMP file", f"first bytes {data[:8]!r}")
    image = out.media_bytes("image", data, ext)
    content = [{"type": "image", "image": image}, {"type": "text", "text": problem.strip()}]
    converted = {
        "messages": [{"role": "user", "content": content}],
        "label": str(solution).strip(),
        "data_source": NAME,
    }
    return converted, f"{image}\0{problem.strip()}\0{solution}"


# --------------------------------------------------------------------------- fixture rows


def fixture_rows(rows: int) -> list[dict[str, Any]]:
    """``rows`` good rows in the published Parquet schema (images of 1-4 squares, "how many" questions),
    then: undecodable image bytes, no solution, no problem."""
    good = []
    for i in range(rows):
        count = i % 4 + 1
        answer = f"<answer>{count}</answer>" if i % 2 == 0 else str(count)
        good.append(
            {
                "image": {"bytes": squares_png(count), "path": f"{i}.png"},
                "problem": f"how many squares are in the image? ({i})",
                "solution": answer,
                "original_question": f"How many squares? ({i})",
                "original_answer": f"The answer is {count}.",
            }
        )
    row = good[0]
    broken = {**row, "image": {"bytes": b"not an image at all", "path": "broken.png"}}
    return [*good, broken, {**row, "solution": ""}, {**row, "problem": None}]


def write_fixture(directory: Path, rows: int) -> Path:
    """The published layout: ``<directory>/data/train-00000-of-00001.parquet``; returns ``directory``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("problem", pa.string()),
            ("solution", pa.string()),
            ("original_question", pa.string()),
            ("original_answer", pa.string()),
        ]
    )
    (directory / "data").mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(fixture_rows(rows), schema=schema)
    pq.write_table(table, directory / "data" / "train-00000-of-00001.parquet")
    return directory
