"""Each audio encoded alone: the Qwen3-Omni audio-encoder patch applied when the adapter loads a model."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


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
    def per_audio(
        input_features: torch.Tensor, feature_lens: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        if feature_lens is None or feature_lens.numel() <= 1:
            return forward(input_features, feature_lens=feature_lens, **kwargs)
        n, outs, start = feature_lens.numel(), [], 0
        for i, length in enumerate(feature_lens.tolist()):  # features: (mel, frames of every audio in turn)
            own = {
                k: v[i : i + 1] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
                for k, v in kwargs.items()
            }
            outs.append(
                forward(
                    input_features[:, start : start + length], feature_lens=feature_lens[i : i + 1], **own
                )
            )
            start += length
        return type(outs[0])(**{key: _cat([o[key] for o in outs]) for key in outs[0].keys()})

    return per_audio


def _cat(values: list[Any]) -> Any:
    """Per-audio outputs joined as one call's: tensors along the token axis, tuples element-wise."""
    if torch.is_tensor(values[0]):
        return torch.cat(values)
    return tuple(_cat(list(parts)) for parts in zip(*values, strict=True))
