"""Pure translation between Relax's generation types and SGLang's native ``/generate`` JSON.

Kept free of I/O so the mapping (sampling params, logprobs, finish reasons, per-token weight versions)
is unit-tested without a server.
"""

from __future__ import annotations

from typing import Any

from relax.core.multimodal_model import AUDIO_IN_VIDEO  # "use_audio_in_video": one flag per video
from relax.core.protocols import GenerationRequest, GenerationResult, SamplingParams


def sampling_params(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ``params`` with ``max_new_tokens`` left to generate."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k
        "max_new_tokens": max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop string/token in the text, as the response ids do
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def generate_payload(
    req: GenerationRequest, rid: str, response_ids: list[int], media: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``/generate`` body continuing ``req`` after ``response_ids`` (its prefix plus tokens so far);
    ``media``: the request's media fields (``media_payload`` of its processed inputs)."""
    left = req.params.max_new_tokens - len(response_ids)
    body = {
        "rid": rid,
        "input_ids": list(req.prompt_ids) + list(response_ids),
        "sampling_params": sampling_params(req.params, left),
        "return_logprob": True,
        "logprob_start_len": -1,  # no prompt logprobs: only the sampled tokens'
    }
    return {**body, **media} if media else body


#: processor outputs (``ProcessedPrompt["inputs"]`` keys) by the ``/generate`` field that carries them
MEDIA_FIELDS: dict[str, tuple[str, ...]] = {
    "image_data": ("pixel_values", "image_grid_thw"),
    "video_data": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid"),
    "audio_data": ("input_features", "feature_attention_mask", "audio_feature_lengths"),
}
_MODALITY = {"image_data": "image", "video_data": "video", "audio_data": "audio"}
#: the Qwen-Omni processors' name for it; sent under SGLang's, the one its attribute->modality map knows
_RENAMED = {"video_second_per_grid": "second_per_grid_ts"}
#: read by SGLang's Qwen processor (for the M-RoPE index) from the FIRST processor_output item only --
#: image, then video, then audio -- so an image item carries them too
_ROPE_LEVEL = ("second_per_grid_ts",)
_NOT_SENT = ("mm_token_type_ids",)  # recomputed by SGLang from the ids


def media_payload(inputs: dict[str, Any]) -> dict[str, Any]:
    """``/generate`` fields for a prompt's processed media: per modality ONE ``processor_output`` item
    (SGLang takes exactly one when inputs are already processed) holding that modality's tensors as
    nested lists (JSON). The prompt ids already contain the expanded media placeholder tokens, as the
    relax-omni processor produced them, so SGLang skips its own processor. Unknown keys are an error.

    The per-video ``use_audio_in_video`` flags become SGLang's request-level ``use_audio_in_video``
    (one per request, so a prompt mixing videos with and without their soundtrack is an error). SGLang
    0.5.23's Qwen processor still builds its M-RoPE index with ``use_audio_in_video=False`` (qwen_vl.py),
    so until it honours the flag such rows get un-interleaved positions on the server. Note: SGLang 0.5.23
    takes these items as tensors (its Python ``Engine`` API); over HTTP the JSON lists fail its feature
    hashing, so such a request fails on a server (see README, relax-sglang)."""
    known = {key: field for field, keys in MEDIA_FIELDS.items() for key in keys}
    unknown = sorted(set(inputs) - set(known) - set(_NOT_SENT) - {AUDIO_IN_VIDEO})
    if unknown:
        raise ValueError(f"media inputs {unknown} have no SGLang /generate field; known: {sorted(known)}")
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in _NOT_SENT or key == AUDIO_IN_VIDEO:
            continue
        field = known[key]
        item = out.setdefault(field, [{"format": "processor_output", "modality": _MODALITY[field]}])[0]
        item[_RENAMED.get(key, key)] = value.tolist() if hasattr(value, "tolist") else value
    video = out.get("video_data", [{}])[0]
    for key in _ROPE_LEVEL:
        if key in video:
            next(out[f][0] for f in MEDIA_FIELDS if f in out)[key] = video[key]
    if AUDIO_IN_VIDEO in inputs and _audio_in_video(inputs):
        out[AUDIO_IN_VIDEO] = True
    return out


def _audio_in_video(inputs: dict[str, Any]) -> bool:
    """The request's one ``use_audio_in_video`` from the per-video flags; videos that disagree are an error."""
    flags = inputs[AUDIO_IN_VIDEO]
    flags = [int(f) for f in (flags.tolist() if hasattr(flags, "tolist") else flags)]
    grid = inputs.get("video_grid_thw")
    videos = 0 if grid is None else len(grid)
    if len(flags) != videos or len(set(flags)) > 1:
        raise ValueError(
            f"media inputs use_audio_in_video {flags} for {videos} videos: SGLang takes one use_audio_in_video "
            "per request; process every video of a prompt with the same use_audio_in_video"
        )
    return bool(flags and flags[0])


def parse_version(value: Any, default: int) -> int:
    """SGLang reports weight versions as strings ("default" before the first update)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def token_versions(meta: dict[str, Any], n: int, default: int) -> list[int]:
    """The weight version of each of the ``n`` output tokens, from ``meta_info.weight_versions`` spans
    (one span per version the request saw); a single ``weight_version`` when the server gives no spans."""
    spans = meta.get("weight_versions") or []
    if not spans:
        return [parse_version(meta.get("weight_version"), default)] * n
    versions = [parse_version(spans[-1]["version"], default)] * n
    for span in spans:
        v = parse_version(span["version"], default)
        for i in range(max(0, span["start"]), min(n, span["end"])):
            versions[i] = v
    return versions


def finish_reason(meta: dict[str, Any]) -> str:
    """Relax's finish reason ("stop" | "length" | "abort") from SGLang's ``meta_info.finish_reason``."""
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise ValueError(f"SGLang finish_reason {reason!r} is not stop, length or abort")


def parse_output(out: dict[str, Any], default_version: int) -> tuple[list[int], list[float], list[int], str]:
    """(token ids, logprobs, versions, finish reason) of one ``/generate`` answer."""
    meta = out["meta_info"]
    ids = [int(t) for t in out.get("output_ids", [])]
    logprobs = [float(lp) for lp, *_ in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise ValueError(f"SGLang returned {len(ids)} tokens but {len(logprobs)} logprobs (rid {meta.get('id')})")
    return ids, logprobs, token_versions(meta, len(ids), default_version), finish_reason(meta)


def cut_at_stop_ids(
    params: SamplingParams, ids: list[int], logprobs: list[float], versions: list[int], reason: str
) -> tuple[list[int], list[float], list[int], str]:
    """SGLang checks ``stop_token_ids`` only when ``ignore_eos`` is off; Relax stops at them either way
    (``ignore_eos`` ignores only EOS), so with ``ignore_eos`` the response is cut after the first stop id."""
    if not (params.ignore_eos and params.stop_token_ids):
        return ids, logprobs, versions, reason
    stop = set(params.stop_token_ids)
    end = next((i + 1 for i, t in enumerate(ids) if t in stop), None)
    if end is None:
        return ids, logprobs, versions, reason
    return ids[:end], logprobs[:end], versions[:end], "stop"


def result(
    req: GenerationRequest, ids: list[int], logprobs: list[float], versions: list[int], reason: str, text: str
) -> GenerationResult:
    """The result for ``req``: its prefix (passed through untouched) followed by what was generated."""
    return GenerationResult(
        request_id=req.request_id,
        response_ids=list(req.prefix_response_ids) + ids,
        logprobs=list(req.prefix_logprobs) + logprobs,
        versions=list(req.prefix_versions) + versions,
        finish_reason=reason,
        text=text,
    )
