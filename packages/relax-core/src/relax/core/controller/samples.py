"""Pure glue between prompts, generation requests, results and ``Sample`` objects."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from relax.core.config import RelaxConfig
from relax.core.data import Sample
from relax.core.protocols import GenerationRequest, GenerationResult, SamplingParams


def sample_seed(seed: int, step: int, group_id: int, index: int) -> int:
    """Per-request seed: reproducible whichever engine or batch serves the request."""
    digest = hashlib.blake2b(f"{seed}/{step}/{group_id}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sampling_params(cfg: RelaxConfig, stop_token_ids: list[int]) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys([*r.stop_token_ids, *([] if r.ignore_eos else stop_token_ids)])),
        stop=tuple(r.stop),
        ignore_eos=r.ignore_eos,
    )


def build_groups(items: list[Any], step: int, cfg: RelaxConfig, first_group_id: int) -> list[list[Sample]]:
    """One group of ``n_samples_per_prompt`` empty samples per prompt item."""
    groups = []
    for offset, item in enumerate(items):
        group_id = first_group_id + offset
        groups.append(
            [
                Sample(
                    prompt_ids=list(item.prompt_ids),
                    group_id=group_id,
                    index_in_group=j,
                    prompt_text=item.prompt_text,
                    label=item.label,
                    metadata=dict(item.metadata),
                    media=list(item.media),
                )
                for j in range(cfg.rollout.n_samples_per_prompt)
            ]
        )
    return groups


def request_for(sample: Sample, params: SamplingParams, seed: int, step: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{step}/{sample.group_id}/{sample.index_in_group}",
        prompt_ids=sample.prompt_ids,
        media=sample.mm_inputs,
        params=replace(params, seed=sample_seed(seed, step, sample.group_id, sample.index_in_group)),
    )


def apply_result(sample: Sample, result: GenerationResult) -> Sample:
    sample.response_ids = list(result.response_ids)
    sample.rollout_logprobs = list(result.logprobs)
    sample.versions = list(result.versions)
    sample.finish_reason = result.finish_reason
    sample.response_text = result.text
    sample.routed_experts = getattr(
        result, "routed_experts", None
    )  # MoE routing replay (relax.core.routing_replay)
    sample.loss_mask = [1.0] * len(result.response_ids)
    return sample
