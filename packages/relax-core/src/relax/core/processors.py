"""Built-in ``text`` processor: a chat message list -> prompt text and token ids.

``data.processor`` selects a registered processor; the dataset calls it for every row whose
prompt goes through the chat template. Multimodal processors (relax-omni) follow the same
protocol and add model inputs (pixel values, grids, audio features) to the returned dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    import torch


class MediaError(ValueError):
    """Bad media in one dataset row: names the row and the item (e.g. ``where="train.jsonl:7"``,
    ``item="messages[0].content[1] image 'cat.png'"``, ``why="truncated image"``), so a run error or a
    counted skip says exactly which file to fix."""

    def __init__(self, where: str, item: str, why: str) -> None:
        self.where, self.item, self.why = where, item, why
        super().__init__(f"{where}: {item}: {why}")

    def __reduce__(self):  # survive pickling across Ray actors with all three fields
        return (type(self), (self.where, self.item, self.why))


class ProcessedPrompt(TypedDict):
    """One prompt after a multimodal processor: computed once when the prompt is drawn, shared by its group."""

    prompt_text: str
    prompt_ids: list[int]
    # the HF processor's model inputs for this ONE prompt except input_ids / attention_mask: pixel_values,
    # image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts, input_features,
    # feature_attention_mask, ...
    inputs: dict[str, torch.Tensor]
    counts: dict[str, int]  # media items loaded, by kind ("image", "video", "audio")


@runtime_checkable
class MultimodalProcessor(Protocol):
    """A processor whose prompts carry media. ``multimodal = True`` makes the dataset keep messages + media
    refs and defer ``process`` to draw time (once per prompt, not per sample, not at load)."""

    multimodal: bool

    def process(
        self, messages: list[dict[str, Any]], media: list[dict[str, Any]], where: str
    ) -> ProcessedPrompt:
        """Load the media (content items of ``messages`` and column refs in ``media``) and run the HF
        processor; raise ``MediaError(where, item, why)`` for any bad item."""
        ...


@runtime_checkable
class SupportsObservationMedia(Protocol):
    """A multimodal processor that can continue a conversation with observation messages carrying media
    (a tool returns an image: ``relax.core.agentic``)."""

    def continue_with(
        self, messages: list[dict[str, Any]], ended_with: str | None, where: str
    ) -> ProcessedPrompt:
        """The token ids (placeholders expanded) and model inputs of ``messages`` rendered as the
        continuation after an assistant turn (``relax.core.agentic.ObservationRenderer``: ``ended_with`` is
        the turn's end-of-turn text, None for a turn cut by length); ``MediaError(where, ...)`` for bad media."""
        ...


def is_multimodal(processor: Any) -> bool:
    return bool(getattr(processor, "multimodal", False)) and callable(getattr(processor, "process", None))


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
        return {
            "prompt_text": text,
            "prompt_ids": list(self.tokenizer.encode(text, add_special_tokens=False)),
        }


def text_processor(params: TextProcessorParams, ctx: Any) -> TextProcessor:
    from transformers import AutoTokenizer

    return TextProcessor(AutoTokenizer.from_pretrained(ctx.tokenizer_path), params.add_generation_prompt)
