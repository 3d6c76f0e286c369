"""Data model: ``Sample`` (one response to one prompt) and collation into a training batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    group_id: int  # all responses to one prompt share it
    index_in_group: int = 0
    prompt_text: str = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    media: list[dict[str, Any]] = field(default_factory=list)  # references to multimodal inputs
    # the processed model inputs of this prompt (pixel values, grids, audio features): one object-store
    # reference (or dict) shared by the whole group, never a copy per sample (relax.core.data_multimodal)
    mm_inputs: Any = None
    response_ids: list[int] = field(default_factory=list)
    response_text: str = ""
    loss_mask: list[float] = field(default_factory=list)  # per response token
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version per response token
    finish_reason: str = ""
    reward: float | None = None
    reward_info: dict[str, float] = field(default_factory=dict)
    # MoE routing replay: the engine's (prompt + response tokens, MoE layers, top_k) expert ids, one int8/int16
    # numpy array (relax.core.routing_replay), None when not recorded
    routed_experts: Any = None

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1

    @property
    def max_version(self) -> int:
        return max(self.versions) if self.versions else -1


def _row(values: Any, r: int, right: int, what: str) -> list[float]:
    """``values`` (one per response token) right-padded with zeros; a length mismatch names the field."""
    if len(values) != r:
        raise ValueError(f"collate: a sample's {what} has {len(values)} entries for {r} response tokens")
    return list(values) + [0.0] * right


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts to P, right-pad responses to R.

    Returns input_ids/attention_mask/position_ids (B, P+R), responses/response_mask/
    rollout_logprobs (B, R), rewards (B,), group_index (B,), min_version (B,); with multimodal samples
    also each row's media inputs, padded per row (``mm.<key>``, see ``relax.core.data_multimodal``), and
    for multi-turn ones ``observation_mask`` (B, R): the observation tokens (where media ids are real); with
    recorded MoE routing ``routed_experts`` (B, P+R, layers, k) int8/int16, -1 where not recorded.
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    p_len = max(len(s.prompt_ids) for s in samples)
    r_len = max(1, max(len(s.response_ids) for s in samples))
    # real tokens as flat lists, scattered into padded tensors: Python touches each token once and never
    # the padding (a long-tailed batch is mostly padding), 4 tensor conversions in all
    ids, mask, lps = [], [], []
    for s in samples:
        r = len(s.response_ids)
        ids += s.prompt_ids
        ids += s.response_ids
        mask += _row(s.loss_mask, r, 0, "loss_mask") if s.loss_mask else [1.0] * r
        lps += _row(s.rollout_logprobs, r, 0, "rollout_logprobs") if s.rollout_logprobs else [0.0] * r
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples])
    response_lens = torch.tensor([len(s.response_ids) for s in samples])
    columns = torch.arange(p_len + r_len)
    attention = (
        (columns >= (p_len - prompt_lens)[:, None]) & (columns < (p_len + response_lens)[:, None])
    ).long()
    input_ids = torch.full(attention.shape, pad_id, dtype=torch.long)
    input_ids[attention.bool()] = torch.tensor(ids, dtype=torch.long)
    real = torch.arange(r_len) < response_lens[:, None]
    response_mask = torch.zeros(real.shape, dtype=torch.float32)
    response_mask[real] = torch.tensor(mask, dtype=torch.float32)
    rollout_lp = torch.zeros(real.shape, dtype=torch.float32)
    rollout_lp[real] = torch.tensor(lps, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    media = {}
    if any(s.mm_inputs is not None for s in samples):
        from relax.core.data_multimodal import pack_media, resolve_all

        media = pack_media(resolve_all([s.mm_inputs for s in samples]))
        if any("episode" in s.metadata for s in samples):  # multi-turn: observation media ids are real
            media["observation_mask"] = (attention[:, p_len:].bool() & (response_mask == 0)).float()
    if any(s.routed_experts is not None for s in samples):  # (B, P + R, MoE layers, top_k), -1: not recorded
        from relax.core.routing_replay import pack_routing

        media["routed_experts"] = pack_routing(
            [s.routed_experts for s in samples], [len(s.prompt_ids) for s in samples], p_len, r_len
        )
    return {
        **media,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "responses": input_ids[:, p_len:].clone(),
        "response_mask": response_mask,
        "rollout_logprobs": rollout_lp,
        "rewards": torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32),
        "group_index": torch.tensor([s.group_id for s in samples], dtype=torch.long),
        "min_version": torch.tensor([s.min_version for s in samples], dtype=torch.long),
    }
