"""What one evaluation of one set reports: its metrics (overall and per source) and its completion rows.

Pure functions over scored ``Sample`` groups (one group = the ``n_samples`` responses to one prompt);
the runner (``relax.core.controller.evaluator``) prefixes the metrics with ``eval/<set>/``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax.core.evaluation.passk import extract_answer, ks_for, maj_at_k, mean_at_k, pass_at_k

SOURCE_PREFIX = "source"  # per-source metrics: eval/<set>/source/<source>/<metric>


def score_of(sample: Any) -> float:
    """The task score: ``reward_info["score"]`` when the reward reports one (shaping left out), else the reward."""
    return float(sample.reward_info.get("score", sample.reward or 0.0))


def correct(sample: Any) -> bool:
    """Counted correct for pass@k: the reward's ``acc`` when it reports one, else a score of at least 1."""
    return bool(sample.reward_info.get("acc", score_of(sample) >= 1.0))


def group_metrics(groups: Sequence[Sequence[Any]]) -> dict[str, float]:
    """accuracy (mean score), pass@k for k = 1, 2, 4, ..., n (unbiased), mean@n and maj@n (n > 1; maj@n
    only where every response gives an answer), response length mean/max, truncation rate, and for
    multi-turn episodes ``turns_mean`` / ``tool_calls_mean`` (plus the other episode counters)."""
    groups = [g for g in groups if g]
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    n = min(len(g) for g in groups)
    lengths = [len(s.response_ids) for s in samples]
    out = {
        "prompts": float(len(groups)),
        "samples": float(len(samples)),
        "accuracy": sum(score_of(s) for s in samples) / len(samples),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "reward/failures": float(sum(s.reward_info.get("reward_failed", 0.0) for s in samples)),
    }
    for k in ks_for(n):
        out[f"pass@{k}"] = sum(pass_at_k(len(g), sum(map(correct, g)), k) for g in groups) / len(groups)
    if n > 1:
        out[f"mean@{n}"] = sum(mean_at_k([score_of(s) for s in g]) for g in groups) / len(groups)
        majorities = [
            maj_at_k([extract_answer(s.response_text) for s in g], [score_of(s) for s in g]) for g in groups
        ]
        if all(m is not None for m in majorities):
            out[f"maj@{n}"] = sum(majorities) / len(majorities)  # type: ignore[arg-type]
    episodes = [s.metadata["episode"] for s in samples if isinstance(s.metadata.get("episode"), dict)]
    for key in sorted({k for e in episodes for k in e}):
        name = {"policy_turns": "turns"}.get(key, key)
        out[f"{name}_mean"] = sum(float(e.get(key, 0.0)) for e in episodes) / len(episodes)
    return out


def source_of(sample: Any, source_key: str | None) -> str | None:
    value = sample.metadata.get(source_key) if source_key else None
    return None if value is None else str(value)


def set_metrics(groups: Sequence[Sequence[Any]], source_key: str | None) -> dict[str, float]:
    """:func:`group_metrics` of the whole set, and of each source (``source/<name>/<metric>``) when
    the rows carry ``source_key`` and there is more than one source."""
    out = group_metrics(groups)
    by_source: dict[str, list[Sequence[Any]]] = {}
    for g in groups:
        if g and (src := source_of(g[0], source_key)) is not None:
            by_source.setdefault(src, []).append(g)
    if len(by_source) > 1 or (by_source and sum(map(len, by_source.values())) < len(groups)):
        for src, gs in sorted(by_source.items()):
            safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in src)
            out.update({f"{SOURCE_PREFIX}/{safe}/{k}": v for k, v in group_metrics(gs).items()})
    return out


def completion_rows(
    groups: Sequence[Sequence[Any]], step: int, version: int, source_key: str | None
) -> list[dict[str, Any]]:
    """One JSON-ready row per response: prompt, response, label, score and reward components, the weight
    versions that wrote it, the answer majority voting saw."""
    rows = []
    for g in groups:
        for s in g:
            info = {k: v for k, v in s.reward_info.items() if isinstance(v, int | float) and math.isfinite(v)}
            rows.append(
                {
                    "step": step,
                    "version": version,
                    "prompt": s.prompt_text,
                    "response": s.response_text,
                    "label": s.label
                    if isinstance(s.label, str | int | float | bool | None)
                    else str(s.label),
                    "score": score_of(s),
                    "correct": correct(s),
                    "reward_info": info,
                    "answer": extract_answer(s.response_text),
                    "source": source_of(s, source_key),
                    "prompt_index": s.group_id,
                    "sample_index": s.index_in_group,
                    "finish_reason": s.finish_reason,
                    "response_tokens": len(s.response_ids),
                    "min_version": s.min_version,
                    "max_version": s.max_version,
                    **({"episode": s.metadata["episode"]} if "episode" in s.metadata else {}),
                }
            )
    return rows


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write ``rows`` beside ``path`` and rename into place (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows), encoding="utf-8")
    part.replace(path)
    return path
