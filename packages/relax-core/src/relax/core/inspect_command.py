"""``relax inspect RUN_DIR [--step N] [--sample I]``: trajectories as the trainer saw them.

Reads ``<run_dir>/samples.jsonl`` (``logging.log_samples: K``) and prints, per sample: the prompt, the
response as spans of trained tokens and masked ones (observations, at loss mask 0), a multi-turn
episode's turns with their tool calls and the observations that answered them, its counters, reward,
advantage and failures; and ``<run_dir>/failures.jsonl``'s rows of that step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (its samples.jsonl: logging.log_samples > 0)")
    parser.add_argument("--step", type=int, help="the step to show (default: the last one logged)")
    parser.add_argument("--sample", type=int, help="only the I-th logged sample of that step")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines instead")


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _short(value: Any, width: int = 400) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_row(row: dict[str, Any]) -> list[str]:
    """One sample as text lines."""
    traj = row.get("trajectory") or {}
    adv = row.get("advantage")
    lines = [
        f"=== step {row['step']} group {row.get('group')} index {row.get('index')}: reward {row.get('reward'):g}"
        + (f", advantage {adv:+.4f}" if adv is not None else "")
        + f", {row.get('response_tokens')} response tokens, "
        f"finish {row.get('finish_reason')}",
        f"prompt: {_short(row.get('prompt'))}",
    ]
    for span in traj.get("spans", []):
        what = "trained" if span["trained"] else "masked "
        text = span.get("text")
        body = repr(text) if text is not None else f"ids {traj['response_ids'][span['start'] : span['end']]}"
        lines.append(f"  [{what} {span['start']:>4}:{span['end']:<4}] {_short(body)}")
    for i, turn in enumerate(traj.get("episode_turns", [])):
        lines.append(f"  turn {i}: {turn.get('tokens')} tokens, finish {turn.get('finish_reason')}")
        for call in turn.get("tool_calls", []):
            if call.get("error"):
                lines.append(f"    malformed tool call: {call['error']}")
            else:
                lines.append(f"    tool call {call['name']}({_short(call.get('arguments'), 200)})")
        for obs in turn.get("observations", []):
            lines.append(f"    observation: {_short(obs, 300)}")
    if "episode" in traj:
        counters = {k: v for k, v in traj["episode"].items() if v}
        lines.append(
            f"  episode: {', '.join(f'{k}={v:g}' for k, v in sorted(counters.items())) or 'no counts'}"
        )
    if traj.get("reward_info"):
        lines.append(f"  reward_info: {_short(traj['reward_info'], 300)}")
    for failure in traj.get("failures", []):
        lines.append(f"  FAILED ({failure['kind']}): {failure['reason']}")
    return lines


def cmd_inspect(ns: argparse.Namespace) -> int:
    run_dir = Path(ns.run_dir)
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        print(
            f"relax: {path} does not exist: run with logging.log_samples: K (K samples per step are logged)",
            file=sys.stderr,
        )
        return 2
    rows = _rows(path)
    if not rows:
        print(f"relax: {path} is empty (no step logged yet)", file=sys.stderr)
        return 1
    steps = sorted({r["step"] for r in rows})
    step = ns.step if ns.step is not None else steps[-1]
    chosen = [r for r in rows if r["step"] == step]
    if not chosen:
        print(
            f"relax: no sample of step {step} in {path}; logged steps: {steps[0]}..{steps[-1]}",
            file=sys.stderr,
        )
        return 2
    if ns.sample is not None:
        if not 0 <= ns.sample < len(chosen):
            print(
                f"relax: --sample {ns.sample}: step {step} has {len(chosen)} logged samples", file=sys.stderr
            )
            return 2
        chosen = [chosen[ns.sample]]
    if ns.json:
        print("\n".join(json.dumps(r, ensure_ascii=False) for r in chosen))
        return 0
    for row in chosen:
        print("\n".join(format_row(row)))
    failures = run_dir / "failures.jsonl"
    if failures.is_file():
        failed = [r for r in _rows(failures) if r.get("step") == step]
        if failed:
            print(f"=== {len(failed)} failure(s) at step {step} (all steps: {failures})")
            print("\n".join(f"  {r['kind']} {r['id']}: {r['reason']}" for r in failed))
    return 0
