"""The agent quick-start's tiny model: a Qwen3 with a tokenizer that can write Hermes tool calls.

Like core's quick-start model (``relax.core.quickstart_model``) it is built locally, never from a
hub: a character-level tokenizer plus whole tokens for the chat roles, the JSON keys a Hermes call
needs (``name``, ``arguments``, ``expression``, ``calculator``) and the ``<tool_call>`` /
``</tool_call>`` markers, so a whole calculator call is ~35 tokens. ``relax.agents.quickstart.warmup``
then teaches it the *format* (see there); RL has to teach it *when* to call the tool.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
#: whole tokens, matched before single characters (``<tool_call>`` before ``tool``)
WORDS = (
    "<tool_call>",
    "</tool_call>",
    "user",
    "assistant",
    "system",
    "tool",
    "calculator",
    "name",
    "arguments",
    "expression",
)
CHARS = tuple("0123456789abcdefghijklmnopqrstuvwxyz") + tuple("+-*/=?.,:;_'\"{}()[]<>| \n")

# A generic ChatML template: every role (``tool`` included) is one ``<|im_start|>role\n...<|im_end|>``
# block, so a tool observation renders as a continuation after the assistant turn that called it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Three layers: copying the operands into the call and the tool's result into the answer is the
# induction-head pattern, which a tiny model learns in a few hundred warm-up steps.
AGENT_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: special tokens and :data:`WORDS` whole, everything else per character."""
    from relax.core.quickstart_model import char_tokenizer

    return char_tokenizer(SPECIAL_TOKENS, WORDS, CHARS, CHAT_TEMPLATE, AGENT_MODEL["max_position_embeddings"])


def build_model(tokenizer: Any, seed: int) -> Any:
    """A seeded, randomly initialised ``Qwen3ForCausalLM`` for ``tokenizer`` (float32)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **AGENT_MODEL,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    return model


def save(model: Any, tokenizer: Any, directory: str | os.PathLike[str]) -> str:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)
