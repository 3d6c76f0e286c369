"""The quick-start model: a tiny Qwen3 and a character-level tokenizer, built locally (no hub).

The quick-start task is single-digit addition ("3+4=" -> "7"). A randomly initialised policy must
already hit the right answer now and then, or RL has no signal to start from; hence a vocabulary
of ~24 tokens (digits, arithmetic characters, chat words, Qwen special tokens) instead of a BPE one:
a uniform policy's first integer is the right sum about 1 time in 20 (4 new tokens), and the
seeded initial model 1 time in 20-40.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Qwen-style special tokens: <|endoftext|> pads, <|im_end|> ends a turn (eos).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
WORDS = ("user", "assistant", "system")
CHARS = tuple("0123456789") + ("+", "-", "*", "=", "?", " ", "\n")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Small enough to step in milliseconds on one CPU core, big enough to memorise 55 sums.
# initializer_range 0.1 (HF default 0.02): the initial policy already depends on the prompt, so GRPO
# is less prone to collapse onto one answer for every prompt (with 0.02 runs plateaued near 0.2,
# always "9"). With the quick-start settings (lr 5e-4, 4 PPO mini-batches, entropy bonus 0.03) reward
# goes 0.04 -> >= 0.8 by step 36-64 across seeds 0-7.
QUICKSTART_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,
}
QUICKSTART_SEED = 0
_FORMAT_VERSION = 1  # bump when the build recipe changes so old caches are not reused


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: special tokens and chat words whole, everything else per character."""
    return char_tokenizer(
        SPECIAL_TOKENS, WORDS, CHARS, CHAT_TEMPLATE, QUICKSTART_MODEL["max_position_embeddings"]
    )


def char_tokenizer(
    special: tuple[str, ...],
    words: tuple[str, ...],
    chars: tuple[str, ...],
    chat_template: str,
    max_length: int,
) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``special + words + chars`` (ids in that order): special
    tokens and ``words`` whole, everything else per character; Qwen's ``<|im_end|>`` ends a turn and
    ``<|endoftext|>`` pads (both must be in ``special``). Tiny task models build theirs with it."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(special + words + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    alternatives = "|".join(re.escape(w) for w in words)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf"{alternatives}|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens are literal text: join without separators
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )
    wrapped.chat_template = chat_template
    return wrapped


def _model_config(tokenizer: Any, **overrides: Any) -> Any:
    from transformers import Qwen3Config

    kwargs = {**QUICKSTART_MODEL, **overrides}
    return Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **kwargs,
    )


def build_tiny_model(directory: str | os.PathLike[str], seed: int = QUICKSTART_SEED, **overrides: Any) -> str:
    """Write a seeded tiny Qwen3 causal LM (safetensors) plus the tokenizer to ``directory``.

    ``overrides`` are ``Qwen3Config`` fields (e.g. ``num_hidden_layers=1``). Deterministic: the same
    seed and overrides give bit-identical weights. Returns the directory as a string.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _model_config(tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def quickstart_fingerprint() -> str:
    """Short hash of everything that determines the quick-start files (names the cache dir)."""
    recipe = {
        "format": _FORMAT_VERSION,
        "vocab": SPECIAL_TOKENS + WORDS + CHARS,
        "template": CHAT_TEMPLATE,
        "model": QUICKSTART_MODEL,
        "seed": QUICKSTART_SEED,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def ensure_quickstart_model(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Path of the quick-start model, building it on first use.

    The root is ``cache_dir``, else ``$RELAX_CACHE_DIR``, else ``~/.cache/relax``; the model lives in
    ``<root>/quickstart-<fingerprint>``. It is built in a temporary sibling and renamed into place,
    so concurrent callers (several Ray actors) never see a half-written directory.
    """
    root = Path(cache_dir or os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")
    target = root / f"quickstart-{quickstart_fingerprint()}"
    if (target / "config.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".quickstart-build-", dir=root))
    try:
        build_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
