import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from relax.core.dataset import DatasetConfig, DatasetError, PromptDataset, load_rows

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    """Character-level WordLevel tokenizer with a ChatML-style template (built locally)."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.add_special_tokens(SPECIALS)
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", chat_template=TEMPLATE)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def plain(path, **kw) -> DatasetConfig:
    """Raw prompts, no length cap (the run config's defaults apply the chat template and cap at 512)."""
    return DatasetConfig(path, **{"apply_chat_template": False, "max_prompt_length": None, **kw})


ROWS = [{"prompt": f"{i}+1=", "label": str(i + 1), "src": "toy", "img": f"img{i}.png"} for i in range(10)]


def test_jsonl_items_are_tokenized_with_label_metadata_media(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = PromptDataset(
        plain(str(f), metadata_keys=("src",), media_keys=("img",), shuffle=False, batch_size=4), tok
    )
    assert ds.stats == {"loaded": 10, "skipped_malformed": 0, "filtered_too_long": 0}
    item = ds.next_batch()[2]
    assert item.prompt_text == "2+1="
    assert item.prompt_ids == [vocab_id(tok, c) for c in "2+1="]
    assert (item.label, item.metadata, item.uid) == ("3", {"src": "toy"}, "d.jsonl:3")
    assert item.media == [{"key": "img", "ref": "img2.png"}]


def vocab_id(tok, ch: str) -> int:
    return tok.convert_tokens_to_ids(ch)


def test_chat_template_with_system_prompt(tmp_path, tok):
    rows = [
        {"prompt": "hi", "label": 1},
        {"prompt": [{"role": "user", "content": "yo"}], "label": 2},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}], "label": 3},
    ]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    ds = PromptDataset(
        plain(str(f), apply_chat_template=True, system_prompt="S", shuffle=False, batch_size=3), tok
    )
    a, b, c = ds.next_batch()
    head = "<|im_start|>system\nS<|im_end|>\n"
    gen = "<|im_start|>assistant\n"
    assert a.prompt_text == head + "<|im_start|>user\nhi<|im_end|>\n" + gen
    assert b.prompt_text == head + "<|im_start|>user\nyo<|im_end|>\n" + gen
    # a row that brings its own system message keeps it (no second system turn)
    assert c.prompt_text == "<|im_start|>system\nown<|im_end|>\n<|im_start|>user\nq<|im_end|>\n" + gen
    assert a.prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(a.prompt_ids) == a.prompt_text


def test_parquet_matches_jsonl(tmp_path, tok):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = dict(metadata_keys=("src",), shuffle=False, batch_size=10)
    from_pq = PromptDataset(plain(str(tmp_path / "d.parquet"), **cfg), tok).next_batch()
    from_js = PromptDataset(plain(str(tmp_path / "d.jsonl"), **cfg), tok).next_batch()
    assert [(i.prompt_ids, i.label, i.metadata) for i in from_pq] == [
        (i.prompt_ids, i.label, i.metadata) for i in from_js
    ]
    # a directory of files reads all of them, in name order
    both = PromptDataset(plain(str(tmp_path), shuffle=False, batch_size=20), tok)
    assert len(both) == 20 and both.items[0].uid == "d.jsonl:1" and both.items[10].uid == "d.parquet:1"


@pytest.mark.parametrize(
    "bad_row, row_no, needle",
    [
        ('{"prompt": "1+1=", "label": ', 3, "row 3: invalid JSON"),
        ({"question": "x", "label": "1"}, 3, "row 3: field 'prompt': missing"),
        ({"prompt": 7, "label": "1"}, 3, "row 3: field 'prompt': expected a non-empty string"),
        ({"prompt": [{"content": "x"}], "label": "1"}, 3, "row 3: field 'prompt': message 0"),
        ({"prompt": "x"}, 3, "row 3: field 'label': missing"),
        ({"prompt": "x", "label": "1", "img": 5}, 3, "row 3: field 'img': media"),
    ],
)
def test_malformed_row_raises_with_file_row_field_or_is_skipped(tmp_path, tok, bad_row, row_no, needle):
    f = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], bad_row, ROWS[2]])
    with pytest.raises(DatasetError) as e:
        PromptDataset(plain(str(f), media_keys=("img",), batch_size=1), tok)
    assert str(f) in str(e.value) and needle in str(e.value)
    ds = PromptDataset(plain(str(f), media_keys=("img",), batch_size=1, on_error="skip"), tok)
    assert ds.stats == {"loaded": 3, "skipped_malformed": 1, "filtered_too_long": 0}


def test_max_prompt_length_drops_and_counts(tmp_path, tok):
    rows = [{"prompt": "x" * n, "label": n} for n in (3, 8, 5, 9)]
    ds = PromptDataset(
        plain(str(write_jsonl(tmp_path / "l.jsonl", rows)), max_prompt_length=5, batch_size=1, shuffle=False),
        tok,
    )
    assert [i.label for i in ds.items] == [3, 5]
    assert ds.stats == {"loaded": 2, "skipped_malformed": 0, "filtered_too_long": 2}


def test_seeded_shuffle_per_epoch(tmp_path, tok):
    f = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    ds = PromptDataset(plain(f, batch_size=5, seed=3), tok)
    epoch0 = [i.uid for _ in range(2) for i in ds.next_batch()]
    epoch1 = [i.uid for _ in range(2) for i in ds.next_batch()]
    assert ds.epoch == 1
    assert sorted(epoch0) == sorted(epoch1) == sorted(i.uid for i in ds.items)
    assert epoch0 != epoch1  # a new order each epoch
    again = PromptDataset(plain(f, batch_size=5, seed=3), tok)
    assert [i.uid for _ in range(2) for i in again.next_batch()] == epoch0
    other = PromptDataset(plain(f, batch_size=5, seed=4), tok)
    assert [i.uid for _ in range(2) for i in other.next_batch()] != epoch0


def test_resume_continues_with_the_same_prompts(tmp_path, tok):
    f = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    cfg = plain(f, batch_size=3, seed=11)  # 10 rows, bs 3: last row of each epoch is dropped
    ref = PromptDataset(cfg, tok)
    stream = iter(ref)
    expected = [[i.uid for i in next(stream)] for _ in range(8)]
    ds = PromptDataset(cfg, tok)
    for _ in range(2):
        ds.next_batch()
    state = json.loads(json.dumps(ds.state_dict()))  # survives a checkpoint round trip
    resumed = PromptDataset(cfg, tok)
    resumed.load_state_dict(state)
    assert [[i.uid for i in resumed.next_batch()] for _ in range(6)] == expected[2:]
    assert resumed.epoch == 2 and resumed.position == 6
    with pytest.raises(DatasetError, match="does not match"):
        PromptDataset(plain(f, batch_size=3, seed=12), tok).load_state_dict(state)
    write_jsonl(Path(f), [{**r, "prompt": r["prompt"] + " "} for r in ROWS])  # same rows, new text
    with pytest.raises(DatasetError, match="does not match"):
        PromptDataset(cfg, tok).load_state_dict(state)


def test_drop_last_false_yields_short_batch(tmp_path, tok):
    ds = PromptDataset(
        plain(str(write_jsonl(tmp_path / "d.jsonl", ROWS)), batch_size=4, drop_last=False), tok
    )
    assert [len(ds.next_batch()) for _ in range(4)] == [4, 4, 2, 4]


def test_without_tokenizer_and_config_errors(tmp_path, tok):
    f = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    ds = PromptDataset(plain(f, batch_size=2))
    assert ds.items[0].prompt_ids == [] and ds.items[0].prompt_text == "0+1="
    with pytest.raises(ValueError, match="need a tokenizer"):
        PromptDataset(plain(f, max_prompt_length=4))
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        PromptDataset(
            plain(f, apply_chat_template=True),
            PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer),
        )
    with pytest.raises(ValueError, match="on_error"):
        plain(f, on_error="ignore")
    with pytest.raises(DatasetError, match="fewer than data.batch_size=64"):
        PromptDataset(plain(f, batch_size=64))


def test_hf_save_to_disk_dir_needs_datasets(tmp_path, monkeypatch):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "state.json").write_text("{}")
    (d / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(
        sys.modules, "datasets", None
    )  # `import datasets` raises ImportError, installed or not
    with pytest.raises(DatasetError, match="datasets.save_to_disk; install the `datasets` package"):
        PromptDataset(plain(str(d), batch_size=1))


def test_load_rows(tmp_path):
    f = write_jsonl(tmp_path / "r.jsonl", [{"a": 1}, "", {"a": 2}])
    assert load_rows(f) == [{"a": 1}, {"a": 2}]
    write_jsonl(f, [{"a": 1}, "[1, 2]"])
    with pytest.raises(DatasetError, match="row 2: expected a JSON object, got list"):
        load_rows(f)
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"a": 1, "s": "x\u2028y"}, {"a": 2}], ensure_ascii=False, indent=1))
    assert load_rows(arr) == [{"a": 1, "s": "x\u2028y"}, {"a": 2}]
    arr.write_text('[{"a": 1}, "oops"]')
    with pytest.raises(DatasetError, match="row 2: expected a JSON object, got str"):
        load_rows(arr)
    (tmp_path / "u.jsonl").write_text(json.dumps({"s": "x\u2028y"}, ensure_ascii=False) + "\n")
    assert load_rows(tmp_path / "u.jsonl") == [{"s": "x\u2028y"}]
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_rows(write_jsonl(tmp_path / "r.csv", ["a,b"]))


def test_defaults_come_from_the_run_config():
    """One source of truth: DatasetConfig's shared fields default to DataConfig's."""
    import dataclasses

    from relax.core.config import DataConfig

    ds, run = DatasetConfig("x.jsonl"), DataConfig()
    shared = {f.name for f in dataclasses.fields(DatasetConfig)} & {
        f.name for f in dataclasses.fields(DataConfig)
    }
    assert {"apply_chat_template", "max_prompt_length", "prompt_key", "on_error", "shuffle"} <= shared
    for name in shared - {"path"}:
        mine, theirs = getattr(ds, name), getattr(run, name)
        assert mine == (tuple(theirs) if isinstance(theirs, list) else theirs), name


def write_bytes_rows(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_bad_utf8_byte_names_file_row_and_offset_or_is_skipped(tmp_path, tok, caplog):
    good = [json.dumps(r).encode() for r in ROWS[:3]]
    bad = b'{"prompt": "caf\xe9", "label": "1"}'  # Latin-1 e-acute: not UTF-8
    f = write_bytes_rows(tmp_path / "enc.jsonl", [good[0], good[1], bad, good[2]])
    offset = len(good[0]) + len(good[1]) + 2 + bad.index(b"\xe9")
    with pytest.raises(DatasetError) as e:
        PromptDataset(plain(str(f), batch_size=1), tok)
    assert (
        str(e.value)
        == f"{f}: row 3: byte offset {offset}: invalid UTF-8 (byte 0xe9: invalid continuation byte)"
    )
    with caplog.at_level("INFO", logger="relax.core.dataset"):
        ds = PromptDataset(plain(str(f), batch_size=1, on_error="skip"), tok)
    assert ds.stats == {"loaded": 3, "skipped_malformed": 1, "filtered_too_long": 0}
    assert [i.uid for i in ds.items] == ["enc.jsonl:1", "enc.jsonl:2", "enc.jsonl:4"]
    assert f"skipped {f}: row 3: byte offset {offset}" in caplog.text
    assert (
        "3 prompts loaded, 1 malformed rows skipped, 0 longer than max_prompt_length=None filtered"
        in caplog.text
    )


def test_bad_utf8_in_a_json_array_names_line_and_offset(tmp_path):
    f = tmp_path / "arr.json"
    data = b'[\n {"a": 1},\n {"a": "\xff"}\n]\n'
    f.write_bytes(data)
    offset = data.index(b"\xff")
    with pytest.raises(
        DatasetError, match=rf"arr.json: line 3: byte offset {offset}: invalid UTF-8 \(byte 0xff"
    ):
        load_rows(f)


def test_utf8_bom_and_crlf_are_fine(tmp_path, tok):
    f = write_bytes_rows(
        tmp_path / "bom.jsonl",
        [b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\r", json.dumps(ROWS[1]).encode() + b"\r"],
    )
    ds = PromptDataset(plain(str(f), batch_size=2, shuffle=False), tok)
    assert [i.prompt_text for i in ds.items] == ["0+1=", "1+1="]


def test_counts_are_logged_once(tmp_path, tok, caplog):
    rows = [{"prompt": "x" * n, "label": n} for n in (3, 8, 5)] + ['{"prompt": ']
    with caplog.at_level("INFO", logger="relax.core.dataset"):
        PromptDataset(
            plain(
                str(write_jsonl(tmp_path / "c.jsonl", rows)),
                max_prompt_length=5,
                batch_size=1,
                on_error="skip",
            ),
            tok,
        )
    lines = [r.getMessage() for r in caplog.records if "prompts loaded" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].endswith(
        "2 prompts loaded, 1 malformed rows skipped, 1 longer than max_prompt_length=5 filtered"
    )
