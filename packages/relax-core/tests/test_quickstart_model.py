import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.core.quickstart_model import (
    CHARS,
    build_tiny_model,
    build_tokenizer,
    ensure_quickstart_model,
    quickstart_fingerprint,
)


def test_tokenizer_is_character_level_and_round_trips():
    tok = build_tokenizer()
    assert len(tok) == 24
    text = "12+3=15\n 7-2=5? 4*2=8"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("user")["input_ids"]) == ["user"]
    assert set(CHARS) <= set(tok.get_vocab())
    assert tok.convert_ids_to_tokens([tok.eos_token_id, tok.pad_token_id]) == ["<|im_end|>", "<|endoftext|>"]


def test_chat_template_is_qwen_style(tmp_path):
    build_tiny_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == [
        "<|im_start|>",
        "user",
        "\n",
        "3",
        "+",
        "4",
        "=",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant",
        "\n",
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "user\n3+4=\nassistant\n"


def test_build_is_deterministic_and_reloads_with_plain_transformers(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", seed=3))
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=3))
    c = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "c", seed=4, num_hidden_layers=1))
    assert type(a).__name__ == "Qwen3ForCausalLM"
    assert a.config.vocab_size == 24 and a.config.num_hidden_layers == 2 and c.config.num_hidden_layers == 1
    assert (tmp_path / "a" / "model.safetensors").is_file()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    ids = torch.tensor([[1, 4, 23, 10, 17, 11, 20]])
    assert a(ids).logits.shape == (1, 7, 24)


def test_ensure_builds_once_into_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path / "env-root"))
    path = ensure_quickstart_model()
    assert path == str(tmp_path / "env-root" / f"quickstart-{quickstart_fingerprint()}")
    weights = os.path.join(path, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert ensure_quickstart_model() == path
    assert os.stat(weights).st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in (tmp_path / "env-root").iterdir()] == [os.path.basename(path)]  # no temp left
    explicit = ensure_quickstart_model(tmp_path / "explicit")  # argument beats the env var
    assert explicit.startswith(str(tmp_path / "explicit"))


@pytest.mark.parametrize("override", [{"num_hidden_layers": 1}, {"hidden_size": 64, "head_dim": 16}])
def test_overrides_reach_the_config(tmp_path, override):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, **override))
    for key, value in override.items():
        assert getattr(model.config, key) == value
