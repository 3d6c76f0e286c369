"""``logging.log_samples: K``: K training samples per step -- prompt, response, reward, advantage, and the
trajectory (token ids, loss mask spans, a multi-turn episode's turns and tool calls) -- to
``<run_dir>/samples.jsonl`` (``relax inspect`` prints them), and as a table to the tracking backends (a W&B
table, TensorBoard text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("step", "prompt", "response", "label", "reward", "advantage", "response_tokens", "finish_reason")


def pick(samples: list[Any], k: int) -> list[int]:
    """Indices of ``k`` samples spread over the step (every group represented before any twice)."""
    if k >= len(samples):
        return list(range(len(samples)))
    stride = len(samples) / k
    return [int(i * stride) for i in range(k)]


def trajectory(sample: Any, tokenizer: Any = None) -> dict[str, Any]:
    """What was trained and what was masked: the response's token ids and loss mask, as spans of equal mask
    (with their text, when ``tokenizer`` is given), plus a multi-turn episode's turns (text, tool calls,
    observations), counters and failures. ``relax inspect`` prints it."""
    ids, mask = list(sample.response_ids), [float(m) for m in sample.loss_mask]
    spans = []
    for i, m in enumerate(mask):
        if spans and spans[-1]["trained"] == (m > 0):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"start": i, "end": i + 1, "trained": m > 0})
    if tokenizer is not None:
        for span in spans:
            span["text"] = tokenizer.decode(ids[span["start"] : span["end"]], skip_special_tokens=False)
    meta = sample.metadata
    extra = {
        key: meta[key] for key in ("episode", "episode_turns", "episode_error", "failures") if key in meta
    }
    return {
        "response_ids": ids,
        "loss_mask": mask,
        "spans": spans,
        "reward_info": dict(sample.reward_info),
        **extra,
    }


def sample_rows(
    step: int, samples: list[Any], advantages: Any, mask: Any, k: int, tokenizer: Any = None
) -> list[dict[str, Any]]:
    """``k`` rows; ``advantages`` / ``mask``: the step's (B, R) tensors in ``samples`` order (the advantage
    shown is the mean over the response's trained tokens); each row's ``trajectory`` (:func:`trajectory`)."""
    rows = []
    for i in pick(samples, k):
        s = samples[i]
        adv = None
        if advantages is not None:
            tokens = float(mask[i].sum())
            adv = float((advantages[i] * mask[i]).sum()) / tokens if tokens else 0.0
        rows.append(
            {
                "step": step,
                "prompt": s.prompt_text,
                "response": s.response_text,
                "label": s.label if isinstance(s.label, str | int | float | None) else str(s.label),
                "reward": float(s.reward or 0.0),
                "advantage": adv,
                "response_tokens": len(s.response_ids),
                "finish_reason": s.finish_reason,
                "group": s.group_id,
                "index": s.index_in_group,
                "trajectory": trajectory(s, tokenizer),
            }
        )
    return rows


class SampleLog:
    """Appends each step's rows to ``samples.jsonl`` (a resumed run drops the rows past its checkpoint) and
    hands them to ``metrics.log_table`` (W&B table, TensorBoard text)."""

    def __init__(
        self,
        run_dir: str | Path,
        k: int,
        metrics: Any = None,
        resume_step: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        """``tokenizer``: decodes each trajectory's spans (what ``relax inspect`` shows)."""
        self.path, self.k, self.metrics, self.tokenizer = (
            Path(run_dir) / "samples.jsonl",
            k,
            metrics,
            tokenizer,
        )
        keep = resume_step if resume_step is not None else -1
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= keep]
        self.path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")

    def record(
        self, step: int, samples: list[Any], advantages: Any = None, mask: Any = None
    ) -> list[dict[str, Any]]:
        rows = sample_rows(step, samples, advantages, mask, self.k, self.tokenizer)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r, default=str) + "\n" for r in rows))
        if self.metrics is not None and rows:
            self.metrics.log_table(
                step, "samples", [[r.get(c) for c in COLUMNS] for r in rows], list(COLUMNS)
            )
        return rows
