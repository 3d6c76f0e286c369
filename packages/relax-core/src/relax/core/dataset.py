"""Prompt datasets: local JSONL / Parquet (or HF ``datasets`` on disk) into batches of ``PromptItem``.

Rows are validated and tokenized once at construction so that bad data fails before any rollout
starts (or is skipped and counted) and so that the order of prompts depends only on the seed, the
epoch and the position: a resumed run continues with exactly the prompts it would have seen.
Every bad row is reported with its file, row and (for bad bytes) byte offset; the counts of
loaded, skipped and filtered rows are logged once and kept in ``stats``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from relax.core.config import DataConfig

log = logging.getLogger(__name__)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_HF_DISK_MARKERS = ("state.json", "dataset_dict.json")


class DatasetError(ValueError):
    """A dataset file is unreadable or a row is malformed (names file, 1-based row and field)."""


@dataclass(frozen=True)
class PromptItem:
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict[str, Any]
    media: list[dict[str, Any]]  # references ({"key": media_key, "ref": value}); nothing is loaded
    uid: str  # "<file name>:<row>", stable across runs
    # multimodal processor: the chat messages, processed (media loaded) only when the prompt is drawn
    messages: list[dict[str, Any]] | None = None


_DATA = DataConfig()  # the run config's ``data:`` section owns the defaults shared with it


@dataclass(frozen=True)
class DatasetConfig:
    """The dataset's settings; fields shared with ``DataConfig`` take their defaults from it."""

    path: str | list[str]  # file, directory of files, list of files, or a datasets.save_to_disk dir
    prompt_key: str = _DATA.prompt_key  # a string, or a list of chat messages [{role, content}]
    label_key: str | None = _DATA.label_key  # None: rows carry no label
    metadata_keys: tuple[str, ...] = tuple(_DATA.metadata_keys)
    media_keys: tuple[str, ...] = tuple(_DATA.media_keys)
    system_prompt: str | None = _DATA.system_prompt  # prepended unless the row's chat already starts with one
    apply_chat_template: bool = _DATA.apply_chat_template
    max_prompt_length: int | None = (
        _DATA.max_prompt_length
    )  # in tokens; longer prompts are dropped and counted
    on_error: Literal["raise", "skip"] = _DATA.on_error
    batch_size: int = 8
    shuffle: bool = _DATA.shuffle
    seed: int = 0
    drop_last: bool = True  # a short last batch per epoch is dropped (batches never span epochs)
    split: str = "train"  # only for a datasets.save_to_disk DatasetDict

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"data.on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("data.system_prompt needs data.apply_chat_template=true")


def _resolve_files(path: str | Path | list[str] | list[Path]) -> list[Path]:
    if isinstance(path, list | tuple):
        return [f for p in path for f in _resolve_files(p)]
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p}: no such file or directory")
    if p.is_file():
        return [p]
    if any((p / m).exists() for m in _HF_DISK_MARKERS):
        return [p]
    files = sorted(f for f in p.iterdir() if f.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if not files:
        raise DatasetError(f"{p}: directory holds no .jsonl/.json/.parquet files")
    return files


def _iter_raw(path: Path, split: str = "train") -> Iterator[tuple[int, dict[str, Any] | DatasetError]]:
    """Yield (1-based row, row dict or the error that row raised); file-level problems raise."""
    if path.is_dir():
        yield from _iter_hf_disk(path, split)
    elif path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for a bad file
            raise DatasetError(f"{path}: cannot read Parquet file: {e}") from e
        yield from enumerate(rows, start=1)
    elif path.suffix in JSONL_SUFFIXES:
        yield from _iter_json(path)
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")


def _bad_utf8(path: Path, where: str, data: bytes, e: UnicodeDecodeError, base: int = 0) -> DatasetError:
    byte = data[e.start : e.start + 1].hex()
    return DatasetError(
        f"{path}: {where}byte offset {base + e.start}: invalid UTF-8 (byte 0x{byte}: {e.reason})"
    )


def _iter_json(path: Path) -> Iterator[tuple[int, dict[str, Any] | DatasetError]]:
    """JSON Lines (row = line number), or a .json file holding one array of objects.

    Lines are decoded one by one, so a bad byte spoils only its row (skippable with
    ``on_error: skip``); in a JSON array it spoils the whole file."""
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise _bad_utf8(path, f"line {line}: ", data, e) from None
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON array: {e.msg} (line {e.lineno})") from e
        for n, row in enumerate(rows, start=1):
            yield n, _object_or_error(path, n, row)
        return
    offset = 0
    for n, raw in enumerate(data.split(b"\n"), start=1):  # bytes: U+2028 inside a string is no line break
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if start == 0 else "utf-8")
        except UnicodeDecodeError as e:
            yield n, _bad_utf8(path, f"row {n}: ", raw, e, base=start)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, DatasetError(f"{path}: row {n}: invalid JSON: {e.msg} (column {e.colno})")
            continue
        yield n, _object_or_error(path, n, row)


def _object_or_error(path: Path, n: int, row: Any) -> dict[str, Any] | DatasetError:
    if isinstance(row, dict):
        return row
    return DatasetError(f"{path}: row {n}: expected a JSON object, got {type(row).__name__}")


def _iter_hf_disk(path: Path, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{path}: this directory was written by datasets.save_to_disk; install the `datasets` "
            "package to read it, or export it to JSONL/Parquet"
        ) from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{path}: split {split!r} not found; splits: {sorted(ds)}")
        ds = ds[split]
    yield from enumerate(ds, start=1)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a JSONL/Parquet file (or directory of them) as dicts; a bad row raises DatasetError."""
    rows = []
    for file in _resolve_files(path):
        for _, row in _iter_raw(file):
            if isinstance(row, DatasetError):
                raise row
            rows.append(row)
    return rows


def _check_messages(value: list[Any]) -> str | None:
    """Why ``value`` is not a chat message list, or None if it is one."""
    if not value:
        return "empty message list"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            return f"message {i} is not a {{role, content}} object"
        if not isinstance(m["content"], str | list):
            return f"message {i} content must be a string or a list of parts"
    return None


def _preview(messages: list[dict[str, Any]]) -> str:
    """The text parts of a multimodal chat (the dataset's fingerprint and logs; the real prompt text
    comes from the processor at draw time)."""
    parts = []
    for m in messages:
        content = m["content"]
        items = [content] if isinstance(content, str) else content
        parts += [c if isinstance(c, str) else str(c.get("text", f"<{c.get('type')}>")) for c in items]
    return "\n".join(parts)


def _media_refs(key: str, value: Any) -> list[dict[str, Any]] | None:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str | dict) for v in values):
        return None
    return [{"key": key, "ref": v} for v in values]


class PromptDataset:
    """Validated, tokenized prompts with a seeded per-epoch order and a resumable cursor."""

    def __init__(self, config: DatasetConfig, tokenizer: Any = None, processor: Any = None) -> None:
        """``processor`` (a ``Processor``, e.g. from ``data.processor``) renders chat prompts; by
        default the built-in text processor over ``tokenizer``."""
        if tokenizer is None and (config.apply_chat_template or config.max_prompt_length):
            raise ValueError("data.apply_chat_template / data.max_prompt_length need a tokenizer")
        if config.apply_chat_template and processor is None:
            from relax.core.processors import TextProcessor

            try:
                processor = TextProcessor(tokenizer)
            except ValueError:
                raise ValueError(
                    "data.apply_chat_template is true but the tokenizer has no chat template"
                ) from None
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        from relax.core.processors import is_multimodal

        self.multimodal = is_multimodal(processor)
        self.stats = {"loaded": 0, "skipped_malformed": 0, "filtered_too_long": 0}
        self.skipped: list[str] = []  # the first few skipped rows' errors
        self.items: list[PromptItem] = []
        for file in _resolve_files(config.path):
            for row_no, row in _iter_raw(file, config.split):
                try:
                    if isinstance(row, DatasetError):
                        raise row
                    item = self._make_item(file, row_no, row)
                except DatasetError as e:
                    if config.on_error == "raise":
                        raise
                    self._skip(str(e))
                    continue
                if config.max_prompt_length and len(item.prompt_ids) > config.max_prompt_length:
                    self.stats["filtered_too_long"] += 1
                    continue
                self.items.append(item)
        self.stats["loaded"] = len(self.items)
        log.info(
            "data %s: %d prompts loaded, %d malformed rows skipped, %d longer than max_prompt_length=%s filtered",
            config.path,
            self.stats["loaded"],
            self.stats["skipped_malformed"],
            self.stats["filtered_too_long"],
            config.max_prompt_length,
        )
        if not self.items:
            raise DatasetError(f"{config.path}: no usable prompts (stats: {self.stats})")
        if config.drop_last and len(self.items) < config.batch_size:
            raise DatasetError(
                f"{config.path}: {len(self.items)} prompts is fewer than data.batch_size={config.batch_size}"
            )
        digest = hashlib.sha256()
        for item in self.items:
            digest.update(f"{item.uid}\0{item.prompt_text}\0".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next prompt
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, epoch_order(epoch)) cache

    def __len__(self) -> int:
        return len(self.items)

    def _skip(self, error: str, show: int = 5) -> None:
        self.stats["skipped_malformed"] += 1
        if len(self.skipped) < show:
            self.skipped.append(error)
            more = " (further skipped rows are only counted)" if len(self.skipped) == show else ""
            log.warning("data: skipped %s%s", error, more)

    def _make_item(self, file: Path, row_no: int, row: dict[str, Any]) -> PromptItem:
        cfg = self.config

        def bad(key: str, why: str) -> DatasetError:
            return DatasetError(f"{file}: row {row_no}: field {key!r}: {why}")

        if cfg.prompt_key not in row:
            raise bad(cfg.prompt_key, f"missing (row has {sorted(row)})")
        prompt = row[cfg.prompt_key]
        if isinstance(prompt, list):
            if (why := _check_messages(prompt)) is not None:
                raise bad(cfg.prompt_key, why)
            if not cfg.apply_chat_template:
                raise bad(cfg.prompt_key, "is a chat message list but data.apply_chat_template is false")
        elif not isinstance(prompt, str) or not prompt:
            raise bad(
                cfg.prompt_key, f"expected a non-empty string or message list, got {type(prompt).__name__}"
            )
        label = None
        if cfg.label_key is not None:
            if cfg.label_key not in row:
                raise bad(cfg.label_key, "missing")
            label = row[cfg.label_key]
        media: list[dict[str, Any]] = []
        for key in cfg.media_keys:
            if row.get(key) is None:
                continue  # media are optional per row
            refs = _media_refs(key, row[key])
            if refs is None:
                raise bad(key, "media must be a path/URL string, a dict, or a list of them")
            media.extend(refs)
        metadata = {k: row[k] for k in cfg.metadata_keys if k in row}
        uid = f"{file.name}:{row_no}"
        if self.multimodal:  # media are loaded at draw time, once per drawn prompt
            messages = self._messages(prompt)
            return PromptItem([], _preview(messages), label, metadata, media, uid, messages)
        text, ids = self._render(prompt)
        return PromptItem(list(ids), text, label, metadata, media, uid)

    def _messages(self, prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def _render(self, prompt: str | list[dict[str, Any]]) -> tuple[str, list[int]]:
        """(prompt text, prompt ids): chat prompts go through the processor, plain ones are encoded."""
        if not self.config.apply_chat_template:
            ids = (
                self.tokenizer.encode(prompt, add_special_tokens=False) if self.tokenizer is not None else []
            )
            return prompt, ids  # type: ignore[return-value]  # lists were rejected above
        out = self.processor(self._messages(prompt))
        return out["prompt_text"], out["prompt_ids"]

    def next_item(self) -> PromptItem:
        """One more prompt (replaces a prompt skipped for bad media), advancing the cursor by one."""
        if self.position >= len(self.items):
            self.epoch, self.position = self.epoch + 1, 0
        if self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        self.position += 1
        return self.items[self._order[1][self.position - 1]]

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of ``items`` in the order epoch ``epoch`` visits them (a function of seed and epoch)."""
        if not self.config.shuffle:
            return list(range(len(self.items)))
        return np.random.default_rng([self.config.seed, epoch]).permutation(len(self.items)).tolist()

    def next_batch(self) -> list[PromptItem]:
        """The next batch; advances the cursor, moving to the next epoch when this one is used up."""
        n, bs = len(self.items), self.config.batch_size
        remaining = n - self.position
        if remaining == 0 or (self.config.drop_last and remaining < bs):
            self.epoch, self.position = self.epoch + 1, 0
        if self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        batch = [self.items[i] for i in self._order[1][self.position : self.position + bs]]
        self.position += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        """Endless batches; the caller decides when to stop (steps or epochs via ``self.epoch``)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.config.seed,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor; refuses a state saved for different data or seed (it would silently diverge)."""
        if state["fingerprint"] != self.fingerprint or state["seed"] != self.config.seed:
            raise DatasetError(
                f"dataset state does not match this dataset: saved fingerprint/seed "
                f"{state['fingerprint']}/{state['seed']}, now {self.fingerprint}/{self.config.seed}"
            )
        if not 0 <= state["position"] <= len(self.items):
            raise DatasetError(
                f"dataset state position {state['position']} out of range 0..{len(self.items)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
