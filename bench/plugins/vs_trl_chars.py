"""The ``chars`` task of ``bench/vs_trl.py``, built locally: TRL's style of synthetic GRPO task, a randomly
initialised ~790 k-parameter Qwen3 with a character-level tokenizer and raw prompts (no chat template).

- tokenizer: ``<pad>``, ``<eos>``, ``<unk>``, ``<bos>``, the digits, ``+ - * =``, space and newline (vocab 20),
  one token per character; ``<eos>`` ends a response, ``<pad>`` pads; nothing is added around a prompt;
- model: Qwen3, hidden 128, 4 layers, 4 heads (2 KV), MLP 384, tied embeddings, HF's default init (0.02),
  seeded: every run of every seed starts from the same weights (as the quick-start model);
- rows: ``"a+b="`` over 1-digit operands, label the sum (0-18: answers of 1-2 characters + ``<eos>``).

Both arms load the directory ``ensure_chars_model()`` writes (cached by a fingerprint of this recipe).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SPECIAL = ("<pad>", "<eos>", "<unk>", "<bos>")
CHARS = tuple("0123456789") + ("+", "-", "*", "=", " ", "\n")
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
SEED = 0
MAX_ANSWER = 18  # 9 + 9


def build_tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        bos_token="<bos>",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )


def build(directory: str | os.PathLike[str]) -> str:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype="float32",
        **MODEL,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return str(directory)


def ensure_chars_model() -> str:
    """The model directory under ``$RELAX_CACHE_DIR`` (default ``~/.cache/relax``), built on first use."""
    recipe = json.dumps({"special": SPECIAL, "chars": CHARS, "model": MODEL, "seed": SEED}, sort_keys=True)
    root = Path(os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")
    target = root / f"vs_trl_chars-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".chars-build-", dir=root))
    try:
        build(tmp)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def chars_rows(count: int, seed: int) -> list[dict[str, str]]:
    from relax.core.tasks.arithmetic import arithmetic_rows

    return arithmetic_rows(count, seed=seed, max_answer=MAX_ANSWER)


def write_rows(path: str | os.PathLike[str], count: int, seed: int) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in chars_rows(count, seed)), encoding="utf-8")
    return str(path)
