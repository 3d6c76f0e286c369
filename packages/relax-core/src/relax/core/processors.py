"""Built-in ``text`` processor: a chat message list -> prompt text and token ids.

``data.processor`` selects a registered processor; the dataset calls it for every row whose
prompt goes through the chat template. Multimodal processors (relax-omni) follow the same
protocol and add model inputs (pixel values, grids, audio features) to the returned dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TextProcessorParams:
    add_generation_prompt: bool = True  # end the prompt with the assistant turn's opening tokens


class TextProcessor:
    """Renders with the tokenizer's chat template, then encodes without extra special tokens (the
    template already holds them; a second BOS would shift every position)."""

    def __init__(self, tokenizer: Any, add_generation_prompt: bool = True) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (set data.apply_chat_template=false)")
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        # tokenize=False then encode: transformers 5 returns a BatchEncoding for tokenize=True
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=self.add_generation_prompt
        )
        return {"prompt_text": text, "prompt_ids": list(self.tokenizer.encode(text, add_special_tokens=False))}


def text_processor(params: TextProcessorParams, ctx: Any) -> TextProcessor:
    from transformers import AutoTokenizer

    return TextProcessor(AutoTokenizer.from_pretrained(ctx.tokenizer_path), params.add_generation_prompt)
