"""Relax's patches to SGLang 0.5.23, applied in the server's processes (see ``sitecustomize`` beside this).

Qwen3-Omni audio, one encoder call per audio. Replaces: ``Qwen3OmniMoeThinkerForConditionalGeneration.
get_audio_feature``'s single call over every audio item of a prefill batch. Why, twice over:
(1) it concatenates the items' features, each padded only to its own request's longest audio, so two
concurrent audio prompts of different lengths crash the scheduler ("Sizes of tensors must match ... Expected
size 50 but got size 80"); (2) Qwen3-Omni's audio encoder pads each 1 s chunk of a call to the call's longest
chunk without masking it, so an audio shorter than 1 s encodes differently beside a longer one. Encoding
each audio alone (its valid frames only) fixes both and matches Relax's trainer and HF engine, which do the
same (``relax.core.multimodal_model.encode_audio_per_item``). Outputs keep the order of the single call.

Installed lazily (the model module is patched right after it is first imported), so a server that never
loads it pays nothing. This file must not import Relax: it runs in the server's environment.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from typing import Any


def per_audio_items(items: list) -> list:
    """Each audio of ``items`` (SGLang ``MultimodalDataItem``: ``feature`` (n, mel, frames), right-padded
    ``feature_attention_mask`` (n, frames)) as its own one-audio item trimmed to its frames, in order."""
    out = []
    for item in items:
        for row, length in enumerate(item.feature_attention_mask.sum(-1).tolist()):
            one = copy.copy(item)  # the cached item keeps its own tensors
            one.feature = item.feature[row:row + 1, ..., : int(length)]
            one.feature_attention_mask = item.feature_attention_mask[row:row + 1, : int(length)]
            out.append(one)
    return out


def encode_audio_per_item(omni) -> None:
    import torch

    cls = omni.Qwen3OmniMoeThinkerForConditionalGeneration
    original = cls.get_audio_feature

    def get_audio_feature(self, items):
        return torch.cat([original(self, [one]) for one in per_audio_items(items)], dim=-2)  # (.., tokens, hidden)

    get_audio_feature.relax_patched = True
    cls.get_audio_feature = get_audio_feature


_pending: dict[str, list[Callable[[Any], None]]] = {}


def after_import(module: str, patch: Callable[[Any], None]) -> None:
    """Run ``patch(module object)`` right after ``module`` is first imported (the server's CPU shims use
    this too)."""
    _pending.setdefault(module, []).append(patch)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        patches = _pending.pop(fullname, None)  # once: the regular finders below must not come back here
        if patches is None:
            return None
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Relax's patches (idempotent)."""
    if not getattr(install, "done", False):
        install.done = True
        after_import("sglang.srt.models.qwen3_omni_moe", encode_audio_per_item)
