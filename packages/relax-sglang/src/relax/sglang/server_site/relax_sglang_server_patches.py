"""Relax's patches to SGLang 0.5.23, applied in the server's processes (see ``sitecustomize`` beside this).

Videos as Relax sent them. Replaces, for a video whose container carries Relax's ``RELAX_VIDEO`` tag (any
other video is unchanged): ``qwen_vl.preprocess_video``'s resize and, where the container also carries
``RELAX_TIMESTAMPS``, the frame indices and fps it reports. Why the times:
Qwen3-VL's processor writes each temporal grid's time into the prompt ("<1.5 seconds>"), computed from
those indices / fps. Relax's processor wrote its times from the original video; the engine sends exactly
the sampled frames, in a container tagged with those times, and the patch reports indices whose pair
means are them at fps 1 -- so SGLang writes the prompt Relax trains on, not times re-derived from its own
sampling of the container (which differ: SGLang truncates its frame indices where qwen-vl-utils rounds).
Also: the processor's video kwargs keep the server's sampling ``fps`` (``--mm-process-config``), which
SGLang drops once it sampled the frames itself; Qwen3-Omni's processor computes each temporal grid's M-RoPE
seconds from it (default 1.0: a 2-grid video at 2 fps got other positions and other greedy tokens).
Why the size: the frames are at the model's patch grid already, and SGLang 0.5.23 resizes every Qwen video
frame to a multiple of 28 (Qwen2.5-VL's grid), which for Qwen3-VL / Qwen3-Omni (32) resamples the pixels
twice (a 5e-3 logprob gap on the tiny Qwen3-VL).

Qwen3-Omni audio, one encoder call per audio. Replaces: ``Qwen3OmniMoeThinkerForConditionalGeneration.
get_audio_feature``'s single call over every audio item of a prefill batch. Why, twice over:
(1) it concatenates the items' features, each padded only to its own request's longest audio, so two
concurrent audio prompts of different lengths crash the scheduler ("Sizes of tensors must match ... Expected
size 50 but got size 80"); (2) Qwen3-Omni's audio encoder pads each 1 s chunk of a call to the call's longest
chunk without masking it, so an audio shorter than 1 s encodes differently beside a longer one. Encoding
each audio alone (its valid frames only) fixes both and matches Relax's trainer and HF engine, which do the
same (``relax.core.multimodal_model.encode_audio_per_item``). Outputs keep the order of the single call.

Host buffers of a CPU server unpinned. Replaces: ``pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]`` (default: pinned,
``cudaHostRegister``-ed memory). Why: ``--enable-return-routed-experts`` (MoE routing replay,
``relax.sglang.routing``) allocates its host cache through it and a CPU-only torch cannot pin memory ("Torch
not compiled with CUDA enabled" at start-up); a server on device ``cpu`` has no accelerator to pin for.

Media embeddings of the old weights dropped on a weight update. Wraps: the scheduler's
``SchedulerWeightUpdaterManager.record_weight_version_after_update`` (every successful disk, tensor,
distributed or IPC update calls it), which now also clears ``mm_schedule.embedding_cache``. Why: SGLang keeps
each image's / video's vision-tower output keyed by the input's hash, across weight updates and
``/flush_cache``, so after a sync of trained towers a prompt whose image it had seen got the old tower's
embeddings under the new version's tag (other greedy tokens than the trainer's weights give).

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
            one.feature = item.feature[row : row + 1, ..., : int(length)]
            one.feature_attention_mask = item.feature_attention_mask[row : row + 1, : int(length)]
            out.append(one)
    return out


def encode_audio_per_item(omni) -> None:
    import torch

    cls = omni.Qwen3OmniMoeThinkerForConditionalGeneration
    original = cls.get_audio_feature

    def get_audio_feature(self, items):
        return torch.cat(
            [original(self, [one]) for one in per_audio_items(items)], dim=-2
        )  # (.., tokens, hidden)

    get_audio_feature.relax_patched = True
    cls.get_audio_feature = get_audio_feature


VIDEO_TAG, TIMESTAMPS_TAG = "RELAX_VIDEO", "RELAX_TIMESTAMPS"  # = relax.sglang.media's


def relax_tags(source: Any) -> dict[str, str] | None:
    """The tags of a video container (bytes or a path) that the Relax engine made, or None for any other."""
    import io

    import av

    try:
        with av.open(io.BytesIO(source) if isinstance(source, bytes) else source) as container:
            tags = dict(container.metadata)
    except (OSError, ValueError, av.error.FFmpegError):
        return None
    return tags if VIDEO_TAG in tags else None


def metadata_with_timestamps(metadata: dict, frames: int, stamps: list[float]) -> dict:
    """Video metadata whose Qwen3-VL timestamps (means of each temporal patch's frame indices / fps) are
    ``stamps``: every frame of a temporal patch gets its patch's time as index, at fps 1."""
    per = max(1, frames // len(stamps))
    return {**metadata, "fps": 1.0, "frames_indices": [s for s in stamps for _ in range(per)]}


def relax_videos_as_sent(qwen_vl) -> None:
    original = qwen_vl.preprocess_video

    async def preprocess_video(vr, *args, **kwargs):
        source = getattr(vr, "_source_bytes", None) or getattr(vr, "_source_path", None)
        tags = None if source is None else relax_tags(source)
        if tags is None:
            return await original(vr, *args, **kwargs)
        # Relax's frames are at the model's patch grid already: factor 1 keeps their size, where SGLang's
        # default would snap a Qwen3 frame (a multiple of 32) to a multiple of Qwen2.5-VL's 28
        video, metadata = await original(vr, *args, **{**kwargs, "image_factor": 1})
        if not tags.get(TIMESTAMPS_TAG):
            return video, metadata
        return video, metadata_with_timestamps(
            metadata, len(video), [float(t) for t in tags[TIMESTAMPS_TAG].split(",")]
        )

    preprocess_video.relax_patched = True
    qwen_vl.preprocess_video = preprocess_video

    keep = qwen_vl._get_processor_video_config

    def processor_video_config(video_config, video_metadata):
        config = keep(video_config, video_metadata)
        if config is not None and "fps" in video_config:
            config = {**config, "fps": video_config["fps"]}  # the frames were sampled at it (see above)
        return config

    qwen_vl._get_processor_video_config = processor_video_config


def clear_media_embeddings_on_update(weight_updater) -> None:
    cls = weight_updater.SchedulerWeightUpdaterManager
    original = cls.record_weight_version_after_update

    def record_weight_version_after_update(self, weight_version):
        from sglang.srt.managers import mm_schedule

        if mm_schedule.embedding_cache is not None:  # the old weights' embeddings (see the module docstring)
            mm_schedule.embedding_cache.clear()
        return original(self, weight_version)

    record_weight_version_after_update.relax_patched = True
    cls.record_weight_version_after_update = record_weight_version_after_update


_pending: dict[str, list[Callable[[Any], None]]] = {}


def unpinned_cpu_host_buffers(common) -> None:
    """A device-``cpu`` server's host buffers as plain CPU tensors (see the module docstring)."""
    import torch

    def plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return torch.empty(dims, dtype=dtype, device="cpu")

    common.ALLOC_MEMORY_FUNCS["cpu"] = plain


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
        after_import("sglang.srt.multimodal.processors.qwen_vl", relax_videos_as_sent)
        after_import("sglang.srt.mem_cache.pool_host.common", unpinned_cpu_host_buffers)
        after_import(
            "sglang.srt.managers.scheduler_components.weight_updater", clear_media_embeddings_on_update
        )
