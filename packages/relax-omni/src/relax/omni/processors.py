"""Qwen-VL / Qwen-Omni (thinker) processors: a chat prompt with media -> prompt ids + model inputs.

One class serves the four families through HF ``AutoProcessor`` (the processor saved beside the model);
a ``Family`` says what differs: the vision patch size qwen-omni-utils resizes to, which media kinds the
model takes, and whether the HF processor takes audio. Core calls ``process`` once per drawn prompt and
shares the result with the whole group (``relax.core.processors.MultimodalProcessor``); calling the
processor on a text-only message list gives the plain prompt (core's ``Processor`` protocol).

Besides the model inputs, a prompt's inputs keep each decoded 16 kHz audio waveform its feature extractor
consumed (audio items and, with ``use_audio_in_video``, video soundtracks, in prompt order) as
``source.audio.<i>`` (``relax.core.data_multimodal.SOURCE``): audio features cannot be inverted, and an
engine that re-processes media (sglang) needs the waveform; models and training batches never see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from relax.core.processors import ProcessedPrompt
from relax.omni.media import MediaBudget, load_media

DROPPED = ("input_ids", "attention_mask")  # core rebuilds these from prompt_ids for every sample


@dataclass(frozen=True)
class Family:
    name: str
    patch_size: int  # vision patch; qwen-omni-utils resizes to multiples of patch_size * 2 (spatial merge)
    kinds: tuple[str, ...]
    processor_classes: tuple[str, ...]  # HF processor class names this family accepts


FAMILIES = {
    "qwen2_5_vl": Family("qwen2_5_vl", 14, ("image", "video"), ("Qwen2_5_VLProcessor",)),
    "qwen3_vl": Family("qwen3_vl", 16, ("image", "video"), ("Qwen3VLProcessor",)),
    "qwen2_5_omni": Family("qwen2_5_omni", 14, ("image", "video", "audio"), ("Qwen2_5OmniProcessor",)),
    "qwen3_omni": Family("qwen3_omni", 16, ("image", "video", "audio"), ("Qwen3OmniMoeProcessor",)),
}


@dataclass(frozen=True)
class OmniProcessorParams(MediaBudget):
    """``data.processor_params`` of the Qwen-VL / Qwen-Omni processors: the media budgets, plus:"""

    add_generation_prompt: bool = True  # end the prompt with the assistant turn's opening tokens


class QwenOmniProcessor:
    multimodal = True

    def __init__(self, hf_processor: Any, family: Family, params: OmniProcessorParams) -> None:
        cls = type(hf_processor).__name__
        if cls not in family.processor_classes:
            raise ValueError(
                f"data.processor {family.name!r} needs a {' or '.join(family.processor_classes)} beside the "
                f"model, found {cls}: pick the processor matching model.path"
            )
        if params.use_audio_in_video and "audio" not in family.kinds:
            raise ValueError(f"data.processor_params.use_audio_in_video: {family.name} takes no audio")
        self.hf, self.family, self.params = hf_processor, family, params
        self.tokenizer = hf_processor.tokenizer

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=self.params.add_generation_prompt
        )

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """A text-only prompt (no media loaded): the chat template, encoded without extra special tokens."""
        text = self._render(messages)
        return {
            "prompt_text": text,
            "prompt_ids": list(self.tokenizer.encode(text, add_special_tokens=False)),
        }

    def process(
        self, messages: list[dict[str, Any]], media: list[dict[str, Any]], where: str
    ) -> ProcessedPrompt:
        loaded = load_media(messages, media, self.params, where, self.family.patch_size, self.family.kinds)
        return self._run(self._render(loaded.messages), loaded)

    def continue_with(
        self, messages: list[dict[str, Any]], ended_with: str | None, where: str
    ) -> ProcessedPrompt:
        """Observation messages with media (a tool's image) rendered as the continuation after an assistant
        turn (``relax.core.processors.SupportsObservationMedia``), within the same media budgets."""
        from relax.core.agentic import ObservationRenderer

        loaded = load_media(messages, [], self.params, where, self.family.patch_size, self.family.kinds)
        return self._run(ObservationRenderer(self.hf).text(loaded.messages, ended_with), loaded)

    def _run(self, text: str, loaded: Any) -> ProcessedPrompt:
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        p = self.params
        if loaded.images:  # the HF processor gets the same budget, so it keeps qwen-omni-utils' sizes
            kwargs["images"] = loaded.images
            kwargs["images_kwargs"] = {"size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels}}
        if loaded.videos:
            kwargs.update(videos=loaded.videos, video_metadata=loaded.video_metadata)
            kwargs["videos_kwargs"] = {
                "do_sample_frames": False,
                "size": {"shortest_edge": p.video_min_pixels, "longest_edge": p.video_max_pixels},
            }
            if (
                len(set(loaded.video_fps)) == 1
            ):  # seconds per temporal grid (M-RoPE time) from the sampled fps
                kwargs["videos_kwargs"]["fps"] = loaded.video_fps[0]
        in_video = self.params.use_audio_in_video and bool(loaded.videos)
        if loaded.audios:
            kwargs["audio"] = loaded.audios
        if in_video:  # each soundtrack is interleaved with its video's frames, chunk by chunk
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=loaded.audio_from_video)
        out = self.hf(**kwargs)
        ids = out["input_ids"][0].tolist()  # placeholders expanded to one token per merged patch / frame
        # prompt_text stays the template text (one placeholder per item): what a server takes beside the media
        inputs = {k: v for k, v in out.items() if k not in DROPPED}
        if in_video:  # one flag per video: the model's rope index must interleave the positions the same way
            import torch

            from relax.omni.adapters import AUDIO_IN_VIDEO

            inputs[AUDIO_IN_VIDEO] = torch.ones(len(loaded.videos), dtype=torch.long)
        inputs.update(source_audio(loaded.audios))
        return ProcessedPrompt(prompt_text=text, prompt_ids=ids, inputs=inputs, counts=loaded.counts)


def source_audio(audios: list[Any]) -> dict[str, Any]:
    """``source.audio.<i>``: the waveforms as tensors sharing the decoded arrays (the very values extracted)."""
    import torch

    from relax.core.data_multimodal import SOURCE

    return {f"{SOURCE}audio.{i}": torch.from_numpy(np.asarray(a)) for i, a in enumerate(audios)}


def make_factory(family: str):
    """``factory(params, ctx)`` for ``family``: loads the HF processor saved beside the model."""
    fam = FAMILIES[family]

    def factory(params: OmniProcessorParams, ctx: Any) -> QwenOmniProcessor:
        from transformers import AutoProcessor

        path = ctx.tokenizer_path or ctx.model_path
        if path is None:
            raise ValueError(f"data.processor {family!r} needs model.path (its processor files live there)")
        return QwenOmniProcessor(AutoProcessor.from_pretrained(path), fam, params)

    factory.__name__ = f"{family}_processor"
    return factory
