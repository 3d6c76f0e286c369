"""Loading and calling VL / Omni models the same way in the engine and the trainer.

Both sides pass the processor's media inputs and the token-type ids and leave ``position_ids`` to the
model, which computes the 3-D M-RoPE positions with its own rope-index function from the ids, the
attention mask (left padding) and the grids: the trainer's positions are by construction those the
rollout forward used.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from relax.core.data_multimodal import model_inputs

#: weight-name prefixes of the media encoders (``trainer.freeze_media_towers`` keeps them fixed and unsynced)
TOWER_PREFIXES = ("visual.", "audio_tower.", "model.visual.", "model.audio_tower.", "thinker.visual.",
                  "thinker.audio_tower.")

#: media-input key of a prompt whose videos carry their soundtracks interleaved (Omni ``use_audio_in_video``):
#: one entry per video; the model's rope index must be told, or audio and video positions come out wrong
AUDIO_IN_VIDEO = "use_audio_in_video"


def is_multimodal_model(model_path: str) -> bool:
    """True when the checkpoint's config is an image/audio-text-to-text model (loaded with
    ``AutoModelForImageTextToText``) rather than a plain causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return AutoConfig.from_pretrained(model_path).model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_model(model_path: str, dtype: str) -> Any:
    """``AutoModelForImageTextToText`` for VL / Omni-thinker checkpoints (audio encoded per item, see
    :func:`encode_audio_per_item`), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_multimodal_model(model_path):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=getattr(torch, dtype))
    encode_audio_per_item(model)
    return model


def encode_audio_per_item(model: Any) -> int:
    """Make each ``audio_tower`` of ``model`` (an encoder called with ``feature_lens``) encode every audio
    alone; returns how many towers it changed.

    Why: Qwen3-Omni's audio encoder pads each 1 s feature chunk of a call to the call's longest chunk and
    does not mask the padding between its convolutions, so an audio shorter than 1 s encodes differently
    alone than beside a longer one. Which audios share a call is an accident of batching (the trainer's
    micro-batches, an engine's prefill batch), so the same row got different logprobs in rollout and
    training. One call per audio makes each audio's encoding its own; ``relax-sglang`` patches SGLang's
    servers the same way. Other towers are unchanged by it (their padding is masked), only slower.
    """
    towers = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "audio_tower"]
    towers = [m for m in towers if "feature_lens" in inspect.signature(m.forward).parameters]
    for tower in towers:
        tower.forward = _per_audio(tower.forward)
    return len(towers)


def _per_audio(forward: Any) -> Any:
    @functools.wraps(forward)
    def per_audio(input_features: torch.Tensor, feature_lens: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if feature_lens is None or feature_lens.numel() <= 1:
            return forward(input_features, feature_lens=feature_lens, **kwargs)
        n, outs, start = feature_lens.numel(), [], 0
        for i, length in enumerate(feature_lens.tolist()):  # features: (mel, frames of every audio in turn)
            own = {k: v[i:i + 1] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v for k, v in kwargs.items()}
            outs.append(forward(input_features[:, start:start + length], feature_lens=feature_lens[i:i + 1], **own))
            start += length
        return type(outs[0])(**{key: _cat([o[key] for o in outs]) for key in outs[0].keys()})

    return per_audio


def _cat(values: list[Any]) -> Any:
    """Per-audio outputs joined as one call's: tensors along the token axis, tuples element-wise."""
    if torch.is_tensor(values[0]):
        return torch.cat(values)
    return tuple(_cat(list(parts)) for parts in zip(*values, strict=True))


def is_tower(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES)


def freeze_towers(model: Any) -> bool:
    """Stop gradients into the media towers; False when the model has none (a text-only LM)."""
    towers = [p for n, p in model.named_parameters() if is_tower(n)]
    for p in towers:
        p.requires_grad_(False)
    return bool(towers)


def _token_id(config: Any, kind: str) -> int | None:
    for key in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return None


def media_token_ids(config: Any) -> list[int]:
    """Placeholder and start/end ids of every media kind the model knows."""
    kinds = ("image", "video", "audio", "vision_start", "vision_end", "audio_start", "audio_end")
    return [i for i in (_token_id(config, k) for k in kinds) if i is not None]


def media_forward_kwargs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: dict[str, torch.Tensor],
    prompt_width: int,
) -> dict[str, Any]:
    """Keyword arguments (``input_ids`` included) that make ``model`` see ``media`` for ``input_ids``.

    The media tensors; token types (text 0, image 1, video 2) where the model's rope index needs them;
    ``position_ids=None``, so the model's own rope-index function computes the 3-D positions; the mask as
    bool (the Omni rope index selects tokens with ``ids[mask]``). Media ids a response sampled (columns
    from ``prompt_width`` on) are fed back as token 0: a response never adds media, and the model's
    placeholder counting and rope index must see only the prompt's. Engine and trainer both do this, so
    their logprobs still agree; the sampled ids themselves are kept as they are. The ``AUDIO_IN_VIDEO``
    flags (one per video) become the model's ``use_audio_in_video``. ``source.*`` entries (original media
    kept for other engines, ``relax.core.data_multimodal.SOURCE``) are dropped.
    """
    response = input_ids[:, prompt_width:]
    media_ids = torch.tensor(media_token_ids(model.config), dtype=input_ids.dtype, device=input_ids.device)
    if response.numel() and torch.isin(response, media_ids).any():
        input_ids = torch.cat([input_ids[:, :prompt_width], response.masked_fill(torch.isin(response, media_ids), 0)], 1)
    media = model_inputs(media)
    flags = media.pop(AUDIO_IN_VIDEO, None)
    kwargs: dict[str, Any] = {**media, "input_ids": input_ids, "position_ids": None,
                              "attention_mask": attention_mask.bool()}
    if flags is not None:  # one bool for the whole batch in HF's rope index: every video must agree
        videos = media.get("video_grid_thw")
        if videos is None or flags.numel() != videos.shape[0]:
            raise ValueError(
                f"a batch mixes videos with and without their soundtrack ({flags.numel()} of "
                f"{0 if videos is None else videos.shape[0]} videos use_audio_in_video): the model's rope index "
                "takes one flag per forward; process every video of a run with the same use_audio_in_video"
            )
        kwargs["use_audio_in_video"] = True
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        for code, kind in ((1, "image"), (2, "video")):
            tok = _token_id(model.config, kind)
            if tok is not None:
                types[input_ids == tok] = code
        kwargs["mm_token_type_ids"] = types
    return kwargs
