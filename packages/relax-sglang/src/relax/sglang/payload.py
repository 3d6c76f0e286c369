"""Pure translation between Relax's generation types and SGLang's native ``/generate`` JSON.

Kept free of I/O so the mapping (sampling params, logprobs, finish reasons, per-token weight versions)
is unit-tested without a server.
"""

from __future__ import annotations

from typing import Any

from relax.core.protocols import GenerationRequest, GenerationResult, SamplingParams
from relax.sglang.media import MediaRequest


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
    req: GenerationRequest,
    rid: str,
    response_ids: list[int],
    media: MediaRequest | None = None,
    routed_experts: bool = False,
    lora_path: str | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body continuing ``req`` after ``response_ids`` (its prefix plus tokens so far);
    ``media``: the request's media in SGLang's HTTP form (collapsed prompt ids + raw media fields);
    ``routed_experts``: ask for every token's MoE routing (``relax.sglang.routing``); ``lora_path``: the
    loaded adapter to generate with (``relax.sglang.lora``)."""
    left = req.params.max_new_tokens - len(response_ids)
    prompt = media.prompt_ids if media is not None else req.prompt_ids
    body = {
        "rid": rid,
        "input_ids": list(prompt) + list(response_ids),
        "sampling_params": sampling_params(req.params, left),
        "return_logprob": True,
        "logprob_start_len": -1,  # no prompt logprobs: only the sampled tokens'
    }
    if routed_experts:
        body["return_routed_experts"] = True
    if lora_path is not None:
        body["lora_path"] = lora_path
    return {**body, **media.fields} if media is not None else body


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
        raise ValueError(
            f"SGLang returned {len(ids)} tokens but {len(logprobs)} logprobs (rid {meta.get('id')})"
        )
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
